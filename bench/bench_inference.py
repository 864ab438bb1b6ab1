"""Benchmark: long-context inference, HypeNet-2B vs the Qwen3-1.7B shape.

Both models are built from random bf16 weights with our own code, so the comparison is of the
architectures, not of two code bases: the teacher shape is the exact all-attention HypeNet that
distillation runs (28 softmax layers with RoPE, GQA 16/8, head dim 128), HypeNet-2B keeps attention
in layers 2,3,6,8,9,21,25 (NoPE + logits scaling) and runs Lightning elsewhere. Batch 1.

For each context T:
* prefill: the prompt goes through the model with a KV cache in chunks of ``--chunk`` tokens (each
  chunk is lower-right causal flash attention over the cache so far; Lightning carries its state),
  only the last position's logits are computed. Time = wall time of the whole prefill
  (CUDA-synchronised).
* decode: ``--decode-steps`` single-token forwards on that cache (median ms per token), twice: the
  eager dynamic-cache forward (``decode_eager_ms``), then the static step replayed as a CUDA graph
  (``StaticDecoder``: split-KV Triton attention over the fixed buffers, ``decode_ms``). The graph's
  first logits are compared with the eager step's at the same position (``graph_rel_err``). Where
  the prefill is not run (``--decode-only`` contexts, e.g. 2M), the cache is filled with random
  keys/values and states of the right size: decode time depends on the cache's size, not its values.
* warm-up: a two-chunk prefill and a few decode steps on a short prompt before any timing, so the
  kernels of both chunk kinds (without / with a carried state) are compiled and autotuned untimed.
* memory: a context is first checked to fit (KV cache + one chunk's activations, allocated for
  real); one that does not fit is reported as ``oom`` without spending minutes computing it.

Writes ``bench/results/inference.json`` (top-level ``prefill_speedup_512k``,
``decode_speedup_512k``, ``max_context_tokens``) and ``inference.png``.

``--real TEACHER_DIR STUDENT_DIR`` measures a trained pair instead: the teacher (any
Llama/Qwen-style HF causal LM folder, or ``smollm2``) re-expressed as the exact all-attention
HypeNet, so both sides run the same kernels and caches, and the student (an exported HypeNet
folder). Real weights, random token ids (the same ids for both models; speed does not depend on the
text). Per context, in one run: prefill tokens/s, decode ms/token (CUDA graph on CUDA, eager
elsewhere), peak memory, and student/teacher ratios. Writes ``bench/results/inference_real.json``
and ``inference_real.png``.

  python bench/bench_inference.py                                   # H200: 32K..1M, 2M decode
  python bench/bench_inference.py --contexts 32768 131072 --teacher-contexts 32768 131072
  python bench/bench_inference.py --contexts --decode-only 524288 2097152 \\
      --teacher-decode-only 524288                                  # decode only
  python bench/bench_inference.py --cpu-smoke                       # tiny shapes on CPU
  python bench/bench_inference.py --real smollm2 out/smol-hypenet   # real pair, 8K..128K
  # real pair, 64/128 tokens on CPU
  python bench/bench_inference.py --real TEACHER STUDENT --cpu-smoke
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import (ATTN_2B, RESULTS, SHAPE_2B, SHAPE_TINY, print_table,  # noqa: E402
                          write_result)
# the timing helpers and the --real pair live in bench/inference/; their names stay importable from
# here, where the other decode benchmarks import them
from bench.inference.real_pair import (describe_model, load_real_pair,  # noqa: E402,F401
                                       measure_context, measure_real_pair, pair_row, plot_real,
                                       run_real)
from bench.inference.timing import (GiB, activation_bytes, decode_ms, fits,  # noqa: E402,F401
                                    kv_bytes, prefill, random_cache, rewind, rnn_states, sync,
                                    timed_steps, warm_up)
from halo_dist.models.hypenet.configuration_hypenet import HypeNetConfig  # noqa: E402
from halo_dist.models.hypenet.modeling_hypenet import HypeNetForCausalLM  # noqa: E402
from halo_dist.models.hypenet.static_decode import DecodeOptions, StaticDecoder  # noqa: E402

REAL_CONTEXTS = [8192, 16384, 32768, 65536, 131072]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--real", nargs=2, metavar=("TEACHER_DIR", "STUDENT_DIR"),
                   help="measure this trained pair (HF teacher folder or 'smollm2', exported "
                        "HypeNet student)")
    p.add_argument("--contexts", type=int, nargs="*", default=None,
                   help="contexts where HypeNet prefills (and decodes); default 32K..1M, with "
                        "--real 8K..128K")
    p.add_argument("--teacher-contexts", type=int, nargs="+", default=None,
                   help="contexts where the teacher shape prefills (default 32K, 128K, 512K); at "
                        "the other --contexts it is only fit-checked")
    p.add_argument("--decode-only", type=int, nargs="*", default=None,
                   help="contexts where HypeNet decodes on a random cache of that size, no prefill "
                        "(default 2M)")
    p.add_argument("--teacher-decode-only", type=int, nargs="*", default=None,
                   help="--decode-only contexts where the teacher shape decodes too (default: fit "
                        "check only)")
    p.add_argument("--chunk", type=int, default=131072, help="prefill chunk (tokens)")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--profile", action="store_true",
                   help="print the top CUDA kernels of one 2-chunk prefill (2 x 32K) and one "
                        "decode step per model")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.real:
        return _real_args(p, a)
    a.contexts = [32768, 131072, 524288, 1048576] if a.contexts is None else a.contexts
    a.teacher_contexts = ([32768, 131072, 524288] if a.teacher_contexts is None
                          else a.teacher_contexts)
    a.decode_only = [2097152] if a.decode_only is None else a.decode_only
    a.teacher_decode_only = a.teacher_decode_only or []
    if a.cpu_smoke:
        a.contexts, a.teacher_contexts, a.decode_only, a.chunk, a.decode_steps = ([64, 128], [64],
                                                                                  [256], 48, 3)
        a.out = a.out or Path("/tmp/halo_dist_inference_smoke.json")
    return a


def _real_args(p, a):
    """--real prefills and decodes both models at every --contexts: the shape-mode options do not
    apply."""
    unused = [flag for flag, v in (("--teacher-contexts", a.teacher_contexts),
                                   ("--decode-only", a.decode_only),
                                   ("--teacher-decode-only", a.teacher_decode_only),
                                   ("--profile", a.profile)) if v]
    if unused:
        p.error(f"{', '.join(unused)} do not apply with --real (both models run at every "
                "--contexts)")
    if a.cpu_smoke:
        a.contexts, a.chunk, a.decode_steps = a.contexts or [64, 128], 48, 3
        a.out = a.out or Path("/tmp/halo_dist_inference_real_smoke.json")
    a.contexts = a.contexts or list(REAL_CONTEXTS)
    if min(a.contexts) < 2:
        p.error("--contexts must be >= 2 tokens")
    return a


def model_configs(smoke: bool) -> dict[str, HypeNetConfig]:
    shape, attn = (SHAPE_TINY, [1]) if smoke else (SHAPE_2B, ATTN_2B)
    L = shape["num_hidden_layers"]
    teacher = HypeNetConfig(**shape, mixer_types=["attention"] * L, attn_rope=True,
                            attn_logits_scale_base=None, attn_output_gate=False, rope_theta=1e6)
    student = HypeNetConfig(
        **shape, mixer_types=["attention" if i in attn else "lightning" for i in range(L)],
        attn_rope=False, attn_logits_scale_base=500.0, rope_theta=1e6)
    return {"qwen3-1.7b-shape": teacher, "hypenet-2b": student}


def build(cfg: HypeNetConfig, device, dtype) -> HypeNetForCausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        model = HypeNetForCausalLM(cfg)
    return model.to(dtype).eval()


def run_one(name, model, T, args, device, dtype, *, do_prefill: bool) -> dict:
    cfg, itemsize = model.config, torch.finfo(dtype).bits // 8
    ok, need = fits(cfg, T, args.chunk, device, itemsize)
    row = {"model": name, "context": T, "prefill_s": None, "decode_ms": None,
           "decode_eager_ms": None, "est_GiB": round(need, 1), "peak_GiB": None, "status": "ok"}
    if not ok:
        row["status"] = "oom"
        return row
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        # eager steps, then (rewound) graph warm-up + steps
        room = args.decode_steps + 4
        if do_prefill:
            row["prefill_s"], cache, last, row["prefill_chunk_s"] = prefill(model, T, args.chunk,
                                                                            device, room)
        else:
            cache, last = (random_cache(model, T, device, dtype, room),
                           torch.zeros(1, dtype=torch.long, device=device))
            row["status"] = "decode-only"
        row.update(decode_ms(model, cache, last, args.decode_steps, device))
        row["decode_ms"] = row["decode_graph_ms"]
        del cache
    except torch.OutOfMemoryError:
        row["status"] = "oom"
    if device.type == "cuda":
        row["peak_GiB"] = round(torch.cuda.max_memory_allocated(device) / GiB, 1)
        torch.cuda.empty_cache()
    return row


def headline(rows: list[dict], T: int) -> dict:
    by = {(r["model"], r["context"]): r for r in rows}
    t, s = by.get(("qwen3-1.7b-shape", T)), by.get(("hypenet-2b", T))
    out = {}
    if t and s and t["prefill_s"] and s["prefill_s"]:
        out["prefill"] = t["prefill_s"] / s["prefill_s"]
    if t and s and t["decode_ms"] and s["decode_ms"]:
        out["decode"] = t["decode_ms"] / s["decode_ms"]
    if t and s and t.get("decode_eager_ms") and s.get("decode_eager_ms"):
        out["decode_eager"] = t["decode_eager_ms"] / s["decode_eager_ms"]
    return out


def profile(model, device, chunk: int = 32768) -> None:
    """Top CUDA kernels of one two-chunk prefill (the second chunk carries state), one eager decode
    step and the static decode step (the kernels a CUDA graph replays). The static step's summed
    kernel time against the graph's wall time per token splits the fixed decode cost into kernel
    work and launch gaps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    with torch_profile(activities=acts) as prof:
        _, cache, last, _ = prefill(model, 2 * chunk, chunk, device, 8)
    print(f"--- profile: prefill 2 x {chunk} ---\n"
          + prof.key_averages().table(sort_by=sort, row_limit=15))
    with torch_profile(activities=acts) as prof, torch.inference_mode():
        model(last.view(1, 1), cache=cache, use_cache=True)
        sync(device)
    print("--- profile: one eager decode step ---\n"
          + prof.key_averages().table(sort_by=sort, row_limit=15))
    dec = StaticDecoder(model, cache, DecodeOptions(use_cuda_graph=False))
    nxt = last.view(1)
    dec.step(nxt)  # first static step (Triton compile) untimed
    steps = 3
    with torch_profile(activities=acts) as prof:
        for _ in range(steps):
            nxt = dec.step(nxt).argmax(-1)
        sync(device)
    events = prof.key_averages()
    print(f"--- profile: {steps} static decode steps (the graph's kernels) ---\n"
          + events.table(sort_by=sort, row_limit=20))
    if device.type == "cuda":
        cuda = torch.autograd.DeviceType.CUDA
        kernel_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
                        for e in events if getattr(e, "device_type", None) == cuda)
        print(f"static step: {kernel_us / steps / 1e3:.3f} ms of CUDA kernel time per token "
              f"(compare decode_graph_ms at this context)")


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("qwen3-1.7b-shape", "hypenet-2b"):
        mine = [r for r in rows if r["model"] == name]
        pre = [(r["context"], r["prefill_s"]) for r in mine if r["prefill_s"]]
        dec = [(r["context"], r["decode_ms"]) for r in mine if r["decode_ms"]]
        if pre:
            axes[0].plot(*zip(*pre), marker="o", label=name)
        if dec:
            axes[1].plot(*zip(*dec), marker="o", label=name)
        for r in mine:
            if r["status"] == "oom":
                axes[1].axvline(r["context"], ls=":", color="gray")
                axes[1].text(r["context"], axes[1].get_ylim()[1] * 0.9, f"{name}\nOOM", fontsize=7)
    for ax, title, unit in ((axes[0], "prefill", "s"), (axes[1], "decode", "ms / token")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(unit)
        ax.set_title(f"{title}, batch 1, bf16")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)

def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.real:
        return run_real(args, device, dtype)
    rows = []
    for name, cfg in model_configs(args.cpu_smoke).items():
        model = build(cfg, device, dtype)
        warm_up(model, args.chunk, device, graph=True)
        if args.profile:
            profile(model, device, chunk=64 if args.cpu_smoke else 32768)
        # the teacher only fit-checks decode-only ones
        contexts = list(args.contexts) + list(args.decode_only)
        for T in contexts:
            runs_here = (T in args.teacher_decode_only if T in args.decode_only
                         else T in args.teacher_contexts)
            teacher_skip = name != "hypenet-2b" and not runs_here
            if teacher_skip:  # only check whether it would fit
                ok, need = fits(cfg, T, args.chunk, device, torch.finfo(dtype).bits // 8)
                row = {"model": name, "context": T, "prefill_s": None,
                       "decode_ms": None, "est_GiB": round(need, 1), "peak_GiB": None,
                       "status": "fits (not run)" if ok else "oom"}
            else:
                row = run_one(name, model, T, args, device, dtype,
                              do_prefill=T not in args.decode_only)
            rows.append(row)
            print_table([row])
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(rows, "inference, batch 1")
    hd = headline(rows, 524288)
    ran = [r["context"] for r in rows
           if r["model"] == "hypenet-2b" and r["status"] in ("ok", "decode-only")]
    payload = {
        "prefill_speedup_512k": hd.get("prefill"),
        "decode_speedup_512k": hd.get("decode"),
        "max_context_tokens": max(ran) if ran else None,
        "decode_eager_speedup_512k": hd.get("decode_eager"),
        "speedups": {T: headline(rows, T) for T in sorted({r["context"] for r in rows})},
        "chunk": args.chunk,
        "rows": rows,
    }
    out = write_result("inference", payload, str(args.out) if args.out else None)
    png = (args.out or RESULTS / "inference.json").with_suffix(".png")
    plot(rows, png)
    if os.environ.get("OUT"):
        plot(rows, Path(os.environ["OUT"]) / "inference.png")
    print(f"\nprefill speedup @512K {hd.get('prefill')}, decode speedup @512K {hd.get('decode')}; "
          f"wrote {out}")
    return payload


if __name__ == "__main__":
    main()
