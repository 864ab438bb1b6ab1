"""MFU of a finished stage run with the attention FLOPs of the keys each token really attended.

Runs logged before the document-aware count (``metrics.attended_context``) used the row length as
the attended context: right for one document per row, ~30x too high at 512K rows of ~17K-token
documents (MFU > 100%). This replays the run's batches (same config, data, seed: the loader is
deterministic) on CPU, computes each step's keys per token, and rescales the logged tokens/s into
MFU.

  python bench/remeasure_mfu.py --metrics bench/results/logs/phaseL_stage3sp2_256k.metrics.jsonl \
      --config configs/bench/stage3_2b.yaml --data .bench_data/long data.seq_len=262144 \
      data.micro_batch_size=1 data.global_batch_size=1 parallel.sp_size=2 --world 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_stages import PEAK  # noqa: E402
from bench.common import ATTN_2B, SHAPE_2B  # noqa: E402
from halo_dist.config.loader import load_config  # noqa: E402
from halo_dist.data import build_loader  # noqa: E402
from halo_dist.models.flops import attention_flops_coefficient, flops_per_token  # noqa: E402
from halo_dist.train.metrics import attended_context  # noqa: E402


def param_counts(shape: dict, attn_layers: list[int]) -> tuple[float, float]:
    """(trained student parameters, teacher parameters) of the bench's HypeNet-2B / Qwen3-1.7B
    shapes, counted on the meta device the way the engine counts them."""
    import torch

    from halo_dist.models.hypenet import HypeNetConfig, HypeNetForCausalLM

    L = shape["num_hidden_layers"]
    with torch.device("meta"):
        teacher = HypeNetForCausalLM(HypeNetConfig(**shape, mixer_types=["attention"] * L,
                                                   attn_rope=True, attn_logits_scale_base=None,
                                                   attn_output_gate=False))
        student = HypeNetForCausalLM(HypeNetConfig(
            **shape,
            mixer_types=["attention" if i in attn_layers else "lightning" for i in range(L)]))
    return (float(sum(p.numel() for p in student.parameters())),
            float(sum(p.numel() for p in teacher.parameters())))


def keys_per_step(cfg, steps: int) -> list[float]:
    """Attended keys per token of each of the run's first ``steps`` steps, from its batches
    replayed."""
    # a step consumes global_batch_size rows in the loader's global order, over all DP ranks and
    # micro-steps: replaying a one-rank loader with micro-batches of the same size visits the same
    # rows
    per_step = cfg.data.global_batch_size // cfg.data.micro_batch_size
    loader = iter(build_loader(cfg.data.train, cfg.data.seq_len, cfg.data.micro_batch_size,
                               seed=cfg.data.seed, shuffle=cfg.data.shuffle, num_workers=0))
    keys = []
    # keys per token of each step's micro-batches (equal token counts: plain mean)
    for _ in range(steps):
        micro = [attended_context(next(loader)["cu_seqlens"]) for _ in range(per_step)]
        keys.append(sum(micro) / len(micro))
    return keys


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--metrics", help="the run's metrics.jsonl")
    p.add_argument("--tokens-per-s", type=float,
                   help="instead of --metrics: the run's mean tokens/s ...")
    p.add_argument("--steps", type=int, help="... over this many steps (1-based, all timed)")
    p.add_argument("--config", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--world", type=int, default=1,
                   help="GPUs of the run (tokens/s is divided by it)")
    p.add_argument("--skip", type=int, default=1,
                   help="first logged steps left out (compile, autotune)")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    cfg = load_config(a.config, [f"data.train={a.data}", *a.overrides])
    if a.metrics:
        rows = [json.loads(line) for line in open(a.metrics) if line.strip()]
    elif a.tokens_per_s and a.steps:
        rows = [{"step": s + 1, "perf/tokens_per_s": a.tokens_per_s} for s in range(a.steps)]
        a.skip = 0
    else:
        p.error("give --metrics, or --tokens-per-s with --steps")
    steps = max(int(r["step"]) for r in rows)
    if cfg.stage.name not in ("stage2", "stage3") or cfg.loss.objective == "ce":
        p.error("only KL stages 2/3 (trained student + forward teacher) are modelled here")
    keys = keys_per_step(cfg, steps)
    n_student, n_teacher = param_counts(SHAPE_2B, ATTN_2B)
    student_attn = len(ATTN_2B) if cfg.stage.name != "stage1" else 0
    coef = attention_flops_coefficient(student_attn, SHAPE_2B["num_hidden_layers"],
                                       SHAPE_2B["num_attention_heads"] * SHAPE_2B["head_dim"])
    base = flops_per_token(n_student, n_teacher)
    out, prev = [], 0
    for r in rows:
        if "perf/tokens_per_s" not in r:
            continue
        step = int(r["step"])
        interval = keys[prev:step]  # logged tokens/s covers the steps since the previous record
        k, prev = sum(interval) / len(interval), step
        mfu = r["perf/tokens_per_s"] / a.world * (base + coef * k) / PEAK
        out.append({"step": step, "tokens_per_s": r["perf/tokens_per_s"],
                    "attended_keys": round(k, 1), "mfu_logged_row_length": r.get("perf/mfu"),
                    "mfu": mfu})
    print("| step | tokens/s | keys/token | MFU (row length, as logged) | MFU (attended keys) |")
    print("|---|---|---|---|---|")
    for o in out:
        print(f"| {o['step']} | {o['tokens_per_s']:.0f} | {o['attended_keys']:.0f} | "
              f"{(o['mfu_logged_row_length'] or 0):.3f} | {o['mfu']:.3f} |")
    timed = out[a.skip:] or out
    summary = {"seq_len": cfg.data.seq_len, "world": a.world, "steps": out,
               "mfu_median": statistics.median(o["mfu"] for o in timed),
               "tokens_per_s_median": statistics.median(o["tokens_per_s"] for o in timed)}
    print(f"median over steps {timed[0]['step']}..{timed[-1]['step']}: MFU "
          f"{summary['mfu_median']:.3f}, {summary['tokens_per_s_median']:.0f} tok/s")
    return summary


if __name__ == "__main__":
    main()
