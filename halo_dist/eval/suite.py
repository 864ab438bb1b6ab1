"""`halo-dist eval-suite`: NIAH, lm-eval CSR and held-out perplexity of one model, loaded once.

The same evaluations as ``eval-niah`` and ``eval-lm`` (same functions, same files), plus held-out
perplexity on pre-tokenized shards, in one process: loading a model and importing the stack costs
more than a small model's evaluation on a GPU. Each part writes its file atomically and is skipped
when that file exists, so an interrupted suite continues where it stopped.

Perplexity is scored on packed held-out rows with document boundaries (``cu_seqlens``), which only
our attention kernels honour; an HF teacher is therefore re-expressed as the exact all-attention
HypeNet the training stages use (same logits, tested) for that part only.

Files in ``--output-dir``: ``niah/<name>.{json,md}`` + ``niah/<name>_heatmap.png``, ``csr.json``,
``ppl.json``.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

from .errors import EvalError
from .reference import ReferenceCache

EXAMPLE = (
    "examples:\n"
    "  halo-dist eval-suite --model runs/demo/hypenet --output-dir runs/demo/eval/student --name "
    "student \\\n"
    "      --niah-lengths 2K,4K,8K --csr-tasks hellaswag,arc_easy --csr-limit 100 --ppl-data "
    "runs/demo/data\n"
    "  halo-dist eval-suite --model smollm2 --output-dir eval/teacher --name teacher --device "
    "cuda --dtype bf16 \\\n"
    "      --niah-lengths 2K,4K,8K,16K,32K,64K --niah-samples 4 --csr-tasks "
    "hellaswag,arc_easy,arc_challenge,piqa,winogrande \\\n"
    "      --csr-batch-size 128 --ppl-data data/corpus --ppl-seq-len 2048\n"
    "\n"
    "Leave a part's main flag empty to skip it (--niah-lengths '', --csr-tasks '', no "
    "--ppl-data).\n")


def add_suite_command(sub) -> None:
    import argparse

    p = sub.add_parser("eval-suite", help="NIAH + lm-eval CSR + held-out perplexity of one model, "
                                          "loaded once", description=__doc__.split("\n\n")[0],
                       epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="model folder (HypeNet or any HF causal LM) or 'smollm2'")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--name", default="model",
                   help="file stem of the NIAH reports (e.g. teacher, student)")
    p.add_argument("--niah-lengths", default="4K",
                   help="comma-separated prompt lengths in model tokens ('' skips)")
    p.add_argument("--niah-tasks", default="",
                   help="NIAH tasks, each optionally @LENGTH, its longest prompt "
                        "(niah_single_1,niah_single_2@8K; default: the three at every length)")
    p.add_argument("--niah-depths", default="5",
                   help="needle depths as fractions or a count of evenly spaced ones")
    p.add_argument("--niah-samples", type=int, default=1,
                   help="prompts per (task, length, depth) cell")
    p.add_argument("--niah-batch-size", type=int, default=4,
                   help="prompts per generate call (at most)")
    p.add_argument("--niah-batch-tokens", type=int, default=0,
                   help="> 0: prompts per call = tokens // length (long prompts alone: no padding "
                        "mask)")
    p.add_argument("--niah-static-decode", action="store_true",
                   help="decode a HypeNet model through its static cache (CUDA graphs on a GPU); "
                        "others unchanged")
    p.add_argument("--niah-prompt-cache",
                   help="folder of built NIAH prompt cells (eval-niah --prompt-cache)")
    p.add_argument("--csr-tasks", default="hellaswag,arc_easy,arc_challenge",
                   help="lm-eval tasks ('' skips)")
    p.add_argument("--csr-limit", type=int, default=0, help="items per task (0: every item)")
    p.add_argument("--csr-batch-size", type=int, default=8)
    p.add_argument("--ppl-data", default="",
                   help="shard manifest whose held-out split is scored ('' skips)")
    p.add_argument("--ppl-split", default="heldout")
    p.add_argument("--ppl-seq-len", type=int, default=2048)
    p.add_argument("--ppl-rows", type=int, default=32)
    p.add_argument("--reference-cache", default="",
                   help="folder of reference figures: a part computed before for the same model "
                        "files, harness and settings is copied from there instead of evaluated "
                        "again, and a part computed now is stored there (a teacher evaluated "
                        "once for all its conversions)")
    p.add_argument("--done-marker", nargs="?", const="DONE", default=None, metavar="NAME",
                   help="write <output-dir>/NAME (default DONE) once every part asked for is "
                        "written; two suites sharing a folder (e.g. NIAH in one process, CSR in "
                        "another) use different names")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    from .commands import add_trust_flag

    add_trust_flag(p)
    p.set_defaults(func=cmd_eval_suite)


def _check_args(args) -> None:
    if args.niah_samples < 1 or args.niah_batch_size < 1 or args.csr_batch_size < 1:
        raise EvalError("--niah-samples, --niah-batch-size and --csr-batch-size must be >= 1")
    if args.csr_limit < 0 or args.ppl_rows < 1 or args.ppl_seq_len < 2:
        raise EvalError("--csr-limit must be >= 0, --ppl-rows >= 1 and --ppl-seq-len >= 2")
    if args.done_marker is not None and (not args.done_marker
                                         or Path(args.done_marker).name != args.done_marker):
        raise EvalError(f"--done-marker {args.done_marker!r}: a file name inside --output-dir, not "
                        "a path")
    if args.ppl_data and not Path(args.ppl_data).exists():
        raise FileNotFoundError(f"--ppl-data {args.ppl_data}: no such shard folder or manifest")


def cmd_eval_suite(args) -> int:
    from .loading import load_model

    _check_args(args)
    out = Path(args.output_dir)
    parts = {"niah": (bool(args.niah_lengths.strip()), out / "niah" / f"{args.name}.json"),
             "csr": (bool(args.csr_tasks.strip()), out / "csr.json"),
             "ppl": (bool(args.ppl_data), out / "ppl.json")}
    todo = [name for name, (wanted, path) in parts.items() if wanted and not path.exists()]
    for name, (wanted, path) in parts.items():
        if wanted and name not in todo:
            print(f"{name}: already done ({path})")
    keys = _reference_keys(args, todo) if args.reference_cache else {}
    cache = ReferenceCache(args.reference_cache) if keys else None
    todo = [name for name in todo if not (cache and _reuse(cache, name, keys[name], args,
                                                           parts[name][1]))]
    if todo:
        model, tokenizer, label = load_model(args.model, args.device, args.dtype,
                                             trust_remote_code=args.trust_remote_code)
        for name in todo:
            t0 = time.time()
            {"niah": _niah, "csr": _csr, "ppl": _ppl}[name](model, tokenizer, label, args,
                                                            parts[name][1])
            print(f"{name}: done in {time.time() - t0:.0f}s -> {parts[name][1]}", flush=True)
            if cache:
                print(f"{name}: stored as reference figures "
                      f"{cache.store(name, keys[name], parts[name][1])}", flush=True)
    if args.done_marker:
        out.mkdir(parents=True, exist_ok=True)
        (out / args.done_marker).write_text(
            json.dumps({n: str(p) for n, (wanted, p) in parts.items() if wanted}))
    return 0


def _reference_keys(args, parts: list[str]) -> dict[str, str]:
    """Each part's reference key: the model folder's files and the settings that part depends on."""
    from ..teacher import teacher_path
    from ..models.convert import resolve_teacher
    from .reference import model_identity, part_key

    model_id = model_identity(resolve_teacher(teacher_path(args.model), "--model").path)
    common = {"dtype": args.dtype, "device": args.device.split(":")[0]}
    keys = {}
    for name in parts:
        if name == "niah":
            settings = {"tasks": args.niah_tasks, "lengths": args.niah_lengths,
                        "depths": args.niah_depths, "samples": args.niah_samples,
                        "batch": [args.niah_batch_size, args.niah_batch_tokens],
                        "static": args.niah_static_decode}
        elif name == "csr":
            settings = {"tasks": args.csr_tasks, "limit": args.csr_limit,
                        "batch": args.csr_batch_size}
        else:  # the held-out text itself, by its shards' checksums
            settings = {"data": _heldout_fingerprint(args), "split": args.ppl_split,
                        "seq_len": args.ppl_seq_len, "rows": args.ppl_rows}
        keys[name] = part_key(name, model_id, {**common, **settings})
    return keys


def _heldout_fingerprint(args) -> str:
    from ..data.manifest import load_manifest

    return load_manifest(args.ppl_data, args.ppl_split).fingerprint()


def _reuse(cache, name: str, key: str, args, path: Path) -> bool:
    """Copy a part's reference figures into the output (NIAH: with its table and heatmap)."""
    if not cache.fetch(name, key, path):
        return False
    if name == "niah":  # its table and heatmap; the summary again from the records (int lengths)
        from .niah_report import summarize, write_reports

        report = json.loads(path.read_text())
        write_reports({**report, "summary": summarize(report["records"])}, path.parent, args.name)
    print(f"{name}: reference figures reused ({cache.path(name, key)})", flush=True)
    return True


def _niah(model, tokenizer, label, args, path: Path) -> None:
    from .niah import TASKS, NiahConfig, parse_depths, parse_lengths, parse_tasks, run_niah
    from .niah_report import write_reports

    tasks, max_length = parse_tasks(args.niah_tasks or ",".join(TASKS))
    cfg = NiahConfig(tasks, parse_lengths(args.niah_lengths), parse_depths(args.niah_depths),
                     args.niah_samples, args.niah_batch_size, batch_tokens=args.niah_batch_tokens,
                     static_decode=args.niah_static_decode, prompt_cache=args.niah_prompt_cache,
                     max_length=max_length)
    report = {"model": label, **run_niah(model, tokenizer, cfg)}
    paths = write_reports(report, path.parent, args.name)
    print(paths["markdown"].read_text())


def _csr(model, tokenizer, label, args, path: Path) -> None:
    from .lm_eval_bridge import markdown, run_lm_eval
    from .selection import write_json_atomic

    tasks = [t.strip() for t in args.csr_tasks.split(",") if t.strip()]
    summary = run_lm_eval(model, tokenizer, tasks, args.csr_limit or None, args.csr_batch_size)
    summary.update(model=label, limit=args.csr_limit or None)
    print(markdown(summary))
    write_json_atomic(path, summary)


def _ppl(model, tokenizer, label, args, path: Path) -> None:
    """Next-token CE over held-out rows of ``--ppl-seq-len`` tokens; perplexity = exp(CE)."""
    from .calibrate import heldout_loss
    from .proxies import heldout_shard_batches
    from .selection import write_json_atomic
    from .stats import Z95

    batch_size = min(8, args.ppl_rows)
    batches = heldout_shard_batches(args.ppl_data, args.ppl_seq_len,
                                    max(1, args.ppl_rows // batch_size), batch_size,
                                    split=args.ppl_split)
    result = heldout_loss(_with_document_masks(model), batches)
    rows = result["row_losses"]
    # the rows are the independent units: the error of the mean CE is their spread over sqrt(n)
    se = statistics.stdev(rows) / math.sqrt(len(rows)) if len(rows) > 1 else float("nan")
    report = {"model": label, "data": str(args.ppl_data),
              "split": args.ppl_split, "seq_len": args.ppl_seq_len,
              "rows": len(rows), "ce": result["loss"], "ce_se": se,
              "ppl": math.exp(result["loss"]),
              "ppl_ci95": [math.exp(result["loss"] - Z95 * se),
                           math.exp(result["loss"] + Z95 * se)],
              "tail_ce": result["tail_loss"], "tokens": result["tokens"], "row_ce": rows}
    print(json.dumps(report))
    write_json_atomic(path, report)


def _with_document_masks(model):
    """The model itself if it is a HypeNet, else its exact all-attention HypeNet (same logits)."""
    from ..models.hypenet import HypeNetForCausalLM

    if isinstance(model, HypeNetForCausalLM):
        return model
    from ..models.convert import as_exact_hypenet

    param = next(model.parameters())
    return as_exact_hypenet(model).to(device=param.device, dtype=param.dtype)
