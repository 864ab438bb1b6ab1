"""Benchmark: from-scratch training throughput of the sweep's 500M models on one GPU.

For each variant (default: HypeNet-Lightning with HyPE and the Transformer baseline of
configs/sweeps/grid.yaml, shape configs/sweeps/base_500m.yaml) it builds the model exactly as stage
``pretrain`` does (``halo_dist.stages.pretrain``: init, parameter groups, fused chunked CE through
``StudentWithLoss``), trains ``--steps`` optimizer steps on random-token batches (bf16 weights,
fused AdamW, 4K context, ``--micro`` sequences per step, documents packed with boundaries every
``--doc-len`` tokens), and reports tokens/s, MFU (6N + attention FLOPs per token,
``stages.pretrain.train_flops_per_token``, with each token attending the ``--doc-len`` keys of its
own document, as the Trainer counts attended keys; H200 bf16 ceiling 779 TFLOP/s), peak memory and
the loss at the first and last step. The first ``--warmup`` steps (fla's Triton autotune, ~2 min on
first use) are excluded from the timing.

No DeepSpeed engine and no data loader: this measures the model + loss + optimizer step, the upper
bound of what the Trainer reaches on one GPU. Parameters and AdamW states are bf16 here (the
Trainer's DeepSpeed bf16 optimizer also keeps fp32 master weights and moments: ~8 more bytes per
parameter, ~5 GB for 600M). Random tokens cannot be learned below the unigram entropy ln(vocab) =
10.8: the loss should fall from ~10.9 toward it, not lower. Each variant's ``wall_s`` includes build
and compilation.

  python bench/bench_pretrain.py                          # on the GPU (< 5 min incl. autotune)
  python bench/bench_pretrain.py --steps 300 --micro 8     # longer / larger micro-batch
  # compiled layers + loss vs eager, same run
  python bench/bench_pretrain.py --runs eager:4 compiled:4 compiled:8
  python bench/bench_pretrain.py --smoke                   # tiny shapes on CPU (tests)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import RESULTS, print_table, write_result  # noqa: E402
from halo_dist.config import load_config  # noqa: E402
from halo_dist.train.metrics import attended_context  # noqa: E402
from halo_dist.stages.pretrain import (build_pretrain_module, param_groups,  # noqa: E402
                                       train_flops_per_token, unique_numel)

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "configs" / "sweeps" / "base_500m.yaml"
PEAK_FLOPS = {"H200": 779e12}  # measured bf16 matmul ceiling; other GPUs: --peak-tflops
VARIANTS = {  # the grid's overrides (configs/sweeps/grid.yaml)
    "hypenet-lightning-hype": ["pretrain.arch=hypenet", "model.rnn_mixer=lightning",
                               "model.pe=hype", "model.attn_layers=0,4,8,12,16,20,24",
                               "model.logits_scaling_a=300"],
    "transformer": ["pretrain.arch=transformer", "model.logits_scaling_a=null",
                    "model.attn_output_gate=false"],
}
SMOKE_SHAPE = ["pretrain.model.vocab_size=512", "pretrain.model.num_hidden_layers=4",
               "pretrain.model.hidden_size=64", "pretrain.model.intermediate_size=128",
               "pretrain.model.num_attention_heads=4", "pretrain.model.num_key_value_heads=2",
               "pretrain.model.head_dim=16", "model.dtype=float32",
               "model.activation_checkpointing=false", "pretrain.model.tokenizer=null",
               "model.attn_layers=[]"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=80,
                   help="timed optimizer steps per variant (80 keeps both variants + autotune "
                        "under ~5 min)")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed first steps (kernel compilation, autotune)")
    p.add_argument("--micro", type=int, default=4,
                   help="sequences per step (one micro-batch, no accumulation)")
    p.add_argument("--runs", nargs="+", default=["eager"], metavar="MODE[:MICRO]",
                   help="settings to time per variant, in one process: eager "
                        "(model.compile=none, loss.backend=auto), compiled (model.compile=layer, "
                        "loss.backend=compiled), shipped (model.compile=layer, loss.backend=auto: "
                        "the sweep configs' settings); :MICRO overrides --micro "
                        "(e.g. --runs eager:4 compiled:4 compiled:8 shipped:8)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--doc-len", type=int, default=1024,
                   help="packed document length (positions restart)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--no-checkpointing", action="store_true",
                   help="disable activation checkpointing")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="MFU ceiling (default: 779 on an H200)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on CPU, fp32 (what the test runs)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON (default bench/results/pretrain.json)")
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.warmup, a.micro, a.seq_len, a.doc_len = (min(a.steps, 6), min(a.warmup, 1), 2,
                                                            64, 32)
        a.lr = 1e-2
        a.out = a.out or Path("/tmp/halo_dist_pretrain_smoke.json")
    a.out = a.out or RESULTS / "pretrain.json"
    return a


MODES = {"eager": ["model.compile=none", "loss.backend=auto"],
         "compiled": ["model.compile=layer", "loss.backend=compiled"],
         "shipped": ["model.compile=layer", "loss.backend=auto"]}


def parse_run(text: str, default_micro: int) -> tuple[str, int]:
    """``"compiled:8"`` -> ``("compiled", 8)``; ``"eager"`` -> ``("eager", --micro)``."""
    mode, _, micro = text.partition(":")
    if mode not in MODES or (micro and not micro.isdigit()):
        raise SystemExit(f"error: --runs {text!r}: expected MODE[:MICRO] with MODE one of "
                         f"{', '.join(MODES)}")
    return mode, int(micro) if micro else default_micro


def variant_config(name: str, a, mode: str = "eager"):
    over = (list(VARIANTS[name]) + [f"data.seq_len={a.seq_len}", f"data.micro_batch_size={a.micro}",
                                    f"data.global_batch_size={a.micro}", f"optim.lr={a.lr}"]
            + MODES[mode])
    if a.smoke:
        over += SMOKE_SHAPE
    if a.no_checkpointing:
        over.append("model.activation_checkpointing=false")
    return load_config(BASE, over)


def packed_cu_seqlens(a) -> torch.Tensor:
    """Boundaries ``[micro * seq_len / doc_len + 1]`` of the ``doc_len``-token documents packed in a
    batch."""
    return torch.arange(0, a.micro * a.seq_len + 1, a.doc_len, dtype=torch.int32)


def random_batch(a, vocab: int, device, gen: torch.Generator) -> dict:
    """``micro`` rows of random tokens, documents of ``doc_len`` packed with cu_seqlens."""
    ids = torch.randint(0, vocab, (a.micro, a.seq_len), generator=gen).to(device)
    pos = (torch.arange(a.seq_len) % a.doc_len).expand(a.micro, -1).contiguous().to(device)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, a.doc_len - 1 :: a.doc_len] = -100  # a document's last token has no successor
    return {"input_ids": ids, "position_ids": pos, "labels": labels,
            "cu_seqlens": packed_cu_seqlens(a).to(device), "max_seqlen": a.doc_len}


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def flops_per_trained_token(config, n_params: int, a) -> float:
    """6N + attention FLOPs with the keys a token really attends, counted as the Trainer counts them
    (``metrics.attended_context`` of the packed documents: ``doc_len`` here), not the row's
    ``seq_len``."""
    keys = attended_context(packed_cu_seqlens(a))
    return train_flops_per_token(config, n_params, a.seq_len, full_attention_keys=keys)


def bench_variant(name: str, a, device, dtype, peak: float | None, mode: str = "eager") -> dict:
    cfg = variant_config(name, a, mode)
    module, _ = build_pretrain_module(cfg)
    module.to(device, dtype)
    student = module.student
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(param_groups(module, cfg.optim.weight_decay), lr=cfg.optim.lr,
                            betas=tuple(cfg.optim.betas), fused=fused or None,
                            foreach=None if fused else True)
    n_params = unique_numel(student)
    fpt = flops_per_trained_token(student.config, n_params, a)
    gen = torch.Generator().manual_seed(0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, t_start = [], None
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            sync(device)
            t_start = time.perf_counter()
        batch = random_batch(a, cfg.pretrain.model.vocab_size, device, gen)
        n_tok = float((batch["labels"] != -100).sum())
        loss, tracked, count = module(**batch, normalizer=n_tok)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.optim.grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step in (0, a.warmup + a.steps - 1):
            losses.append(float(tracked) / max(1, int(count)))
    sync(device)
    seconds = time.perf_counter() - t_start
    tok_s = a.steps * a.micro * a.seq_len / seconds
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    mixers = student.config.mixer_types
    row = {"variant": name, "mode": mode, "params_M": n_params / 1e6,
           "attn_layers": mixers.count("attention"), "micro": a.micro, "seq_len": a.seq_len,
           "steps": a.steps, "step_s": seconds / a.steps, "tokens_per_s": tok_s,
           "gflop_per_token": fpt / 1e9, "mfu": tok_s * fpt / peak if peak else None,
           "peak_mem_gib": peak_gib, "loss_first": losses[0], "loss_last": losses[-1]}
    del module, student, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def best_mfu_keys(rows: list[dict]) -> dict:
    """``<variant>_mfu`` (the best run of the variant: what a sweep would be configured to run) and
    ``<variant>_mfu_eager`` (its first eager run, the baseline of the same process)."""
    keys = {}
    for r in rows:
        if "error" in r or r.get("mfu") is None:
            continue
        stem = r["variant"].replace("-", "_")
        keys[f"{stem}_mfu"] = max(keys.get(f"{stem}_mfu", 0.0), r["mfu"])
        if r["mode"] == "eager":
            keys.setdefault(f"{stem}_mfu_eager", r["mfu"])
    return keys


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.smoke:
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --smoke", file=sys.stderr)
            return 2
        device, dtype = torch.device("cuda"), torch.bfloat16
        torch.backends.cuda.matmul.allow_tf32 = True
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    peak = (a.peak_tflops * 1e12 if a.peak_tflops
            else next((v for k, v in PEAK_FLOPS.items() if k in name.upper()), None))
    names = [n.strip() for n in a.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"error: unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    runs = [parse_run(r, a.micro) for r in a.runs]
    rows = []

    def save():  # after every run, so a run cut short by its time limit keeps the finished ones
        return write_result("pretrain",
                            {"peak_flops": peak, "args": {k: str(v) for k, v in vars(a).items()},
                             **best_mfu_keys(rows), "results": rows}, out=str(a.out))

    for n in names:
        for mode, micro in runs:
            t0 = time.perf_counter()
            a.micro = micro
            try:
                rows.append(bench_variant(n, a, device, dtype, peak, mode))
            except torch.OutOfMemoryError as e:  # record and go on: try a smaller micro-batch
                rows.append({"variant": n, "mode": mode, "micro": micro,
                             "error": f"OOM: {str(e)[:160]}"})
                torch.cuda.empty_cache()
            rows[-1]["wall_s"] = time.perf_counter() - t0
            print(rows[-1], flush=True)
            save()
    print_table(rows, f"from-scratch training, {name}, {'fp32' if a.smoke else 'bf16'}, micro x "
                      f"{a.seq_len} tokens per step")
    ok = all("error" not in r and math.isfinite(r["loss_last"]) for r in rows)
    print(f"wrote {save()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
