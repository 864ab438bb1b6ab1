"""Kernel-level profile of the CUDA-graph decode step: where the time of one token goes.

For each model shape (the Qwen3-1.7B-shape teacher as the exact all-attention HypeNet, and
HypeNet-2B), random bf16 weights, batch 1, a random cache of ``--context`` tokens (decode cost
depends on the cache's size, not its values):

1. the graph step's wall time per token (median of ``--steps`` replays, CUDA-synchronised);
2. ``torch.profiler`` over ``--profiled`` replays of the same graph: every kernel the graph runs,
   with its GPU duration. Per step: the kernels' summed time (``busy``), the span from the first
   kernel's start to the last one's end, and the gaps between kernels (``span - busy``: the graph's
   per-node launch cost);
3. the kernels grouped by what they do (GEMM/GEMV, split-KV attention, its merge, the RNN
   recurrence, norms, copies, other elementwise work), and the 20 costliest kernels;
4. the bytes the step must read (weights + KV cache + RNN states, once each) and the time they take
   at ``--bandwidth`` (the bytes bound), so the table says how far each model is from its bound.

``--variants`` times alternative decode paths in the same process (same weights, same cache size):
``graph`` (the default StaticDecoder: packed input projections, Lightning's state updated in place),
``baseline`` (both off: a GEMM per projection, fla's recurrent kernel and a state copy),
``separate`` (packing off only), ``fla`` (in-place update off only), ``compiled`` (the step through
``torch.compile`` before capture; ``-gemv``, ``-cublas``: the batch-1 GEMV forced on or off;
``-unfused``: the Lightning layer step unfused) and ``compiled-every4`` (the OPD rollout decoder's
states written every 4 tokens; the bytes bound still counts fp32 states written every token).
Writes ``bench/results/decode_profile.json``.

  python bench/profile_decode.py                              # H200, 512K and 32K
  python bench/profile_decode.py --contexts 524288 --variants graph compiled
  python bench/profile_decode.py --models hypenet-2b --batch 256 --contexts 2304 \\
      --out bench/results/decode_profile_b256.json
  python bench/profile_decode.py --models hypenet-2b --contexts 524288 --prefill \\
      --variants baseline graph compiled
  python bench/profile_decode.py --models hypenet-2b --contexts 2097152 --prefill --tile 131072 \\
      --variants compiled --steps 8 --profiled 2     # graph vs eager at 2M on real keys
  python bench/profile_decode.py --models hypenet-2b --batch 512 --contexts 1280 \\
      --variants compiled compiled-every4     # an OPD rollout step, writes deferred
  python bench/profile_decode.py --cpu-smoke                  # tiny shapes on CPU (the script runs)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_inference import (build, model_configs, prefill, random_cache,  # noqa: E402
                                   rewind, rnn_states, sync)
from bench.common import decode_bandwidth, launch_settings, print_table, write_result  # noqa: E402
from halo_dist.models.hypenet.cache_hypenet import HypeNetCache  # noqa: E402
from halo_dist.models.hypenet.static_decode import DecodeOptions, StaticDecoder  # noqa: E402

# (group, pattern on the kernel name); the first match wins
GROUPS = [
    ("attention split-KV", r"_split_kv|split_kv|flash_decod"),
    ("rnn recurrence", r"fused_recurrent|recurrent|lightning"),
    ("gemm/gemv", r"gemm|gemv|cutlass|nvjet|xmma|cublas|sm90_|splitK|dot_kernel"),
    ("rms norm", r"rms|norm"),
    ("copy/cast", r"copy|Memcpy|memcpy|cast|index_put|index_copy|scatter"),
    ("reduce", r"reduce|max_kernel|sum_kernel|softmax|argmax"),
    ("elementwise", r"elementwise|vectorized|unrolled|triton_poi|fused_"),
]


# variant -> StaticDecoder options
VARIANTS = {
    "graph": {},
    "baseline": dict(pack_projections=False, lightning_in_place=False),
    "separate": dict(pack_projections=False),
    "fla": dict(lightning_in_place=False),
    # the shipped decoder: at batch 1 on CUDA, the GEMV kernel for the weight shapes where it beat
    # cuBLAS (decode_gemv.tune_gemv)
    "compiled": dict(compile=True),
    "compiled-gemv": dict(compile=True, gemv=True),
    "compiled-cublas": dict(compile=True, gemv=False),
    # Lightning's norms, RoPE and gate as Inductor's kernels around the in-place update (the fused
    # layer step is the default)
    "compiled-unfused": dict(compile=True, fuse_lightning=False),
    # the OPD rollout decoder's states written back every 4 tokens (opd.rollout_state_write_every)
    "compiled-every4": dict(compile=True, state_write_every=4),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[524288, 32768])
    p.add_argument("--models", nargs="+", default=["qwen3-1.7b-shape", "hypenet-2b"])
    p.add_argument("--variants", nargs="+", default=["graph"], choices=list(VARIANTS))
    p.add_argument("--batch", type=int, default=1,
                   help="rows decoded together (e.g. 256 at a 2K context: an OPD rollout step)")
    p.add_argument("--prefill", action="store_true",
                   help="prefill random token ids (batch 1) instead of a random cache, and "
                        "compare each variant's first logits with the eager dynamic-cache step "
                        "(rel_err_vs_eager)")
    p.add_argument("--chunk", type=int, default=131072, help="prefill chunk (tokens)")
    p.add_argument("--tile", type=int, default=None,
                   help="with --prefill: prefill only this many tokens and repeat their keys and "
                        "values up to the context (the RNN states are the tile's): real keys at "
                        "a length whose prefill would take too long (2M: ~8 min on an H200)")
    p.add_argument("--steps", type=int, default=32, help="timed replays per variant")
    p.add_argument("--profiled", type=int, default=4, help="profiled replays per variant")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="bytes/s for the bytes bound (default: this card's entry in "
                        "bench.common.DECODE_BANDWIDTH: H200 4.4e12, H100 3.35e12)")
    p.add_argument("--launch-settings", type=Path, default=None,
                   help="also measure every variant with the decode-kernel launch settings of "
                        "bench/tune_decode_kernels.py (rows '<variant>+tuned'), same process")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.prefill and a.batch != 1:
        p.error("--prefill runs at batch 1")
    if a.tile is not None and (not a.prefill or a.tile < 1):
        p.error("--tile needs --prefill and a positive token count")
    if a.cpu_smoke:
        a.contexts, a.steps, a.profiled, a.chunk = [64], 3, 1, 48
        a.out = a.out or Path("/tmp/halo_dist_decode_profile_smoke.json")
    return a


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if re.search(pattern, name, re.IGNORECASE):
            return group
    return "other"


def step_bytes(model, context: int, rows: int) -> dict:
    """Bytes one decode step must read at least once: every weight (the tied lm_head once), the KV
    cache of the attention layers and the fp32 states of the RNN layers (read and written)."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    attn = sum(m == "attention" for m in cfg.mixer_types)
    itemsize = next(model.parameters()).element_size()
    kv = rows * 2 * attn * context * cfg.num_key_value_heads * cfg.head_dim * itemsize
    rnn = (rows * (cfg.num_hidden_layers - attn) * cfg.num_attention_heads * cfg.head_dim ** 2 * 4
           * 2)
    return {"weights_GB": weights / 1e9, "kv_GB": kv / 1e9, "rnn_state_GB": rnn / 1e9,
            "total_GB": (weights + kv + rnn) / 1e9}


def timed(dec: StaticDecoder, steps: int, device) -> float:
    """ms of one ``dec.step`` (host-synchronised, as a user's decode loop sees it): the median over
    whole write periods of each period's mean step. A decoder that writes its states every n tokens
    has one dearer step in n, which a median of single steps would leave out (at 384 rows, fp32
    every 4: ~3 ms more, 0.7 ms a token)."""
    token = torch.zeros(dec.tokens.shape[0], dtype=torch.long, device=device)
    period = write_period(dec)
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        dec.step(token)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    times = times[1:] if len(times) > period + 1 else times
    means = [statistics.fmean(times[i:i + period])
             for i in range(0, len(times) - period + 1, period)]
    return statistics.median(means or [statistics.fmean(times)])


def write_period(dec: StaticDecoder) -> int:
    """Tokens between the decoder's state writes (1: every token)."""
    return max((d.every for d in dec.cache.deferred.values()), default=1)


def device_kernels(prof) -> list[tuple[str, float, float]]:
    """``(name, start_us, duration_us)`` of every GPU kernel/memcpy/memset in the trace, by start
    time."""
    out = []
    for e in prof.events():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        out.append((e.name, float(e.time_range.start),
                    float(e.time_range.end - e.time_range.start)))
    return sorted(out, key=lambda k: k[1])


def split_steps(kernels: list, steps: int) -> list[list]:
    """The trace's kernels cut into ``steps`` replays at the ``steps - 1`` widest gaps (replays are
    separated by a host synchronisation, far longer than any gap inside one graph)."""
    if steps <= 1 or len(kernels) < steps:
        return [kernels]
    gaps = sorted(range(1, len(kernels)),
                  key=lambda i: kernels[i][1] - (kernels[i - 1][1] + kernels[i - 1][2]))
    cuts = sorted(gaps[-(steps - 1):])
    bounds = [0, *cuts, len(kernels)]
    return [kernels[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def profile_steps(dec: StaticDecoder, steps: int, device) -> dict:
    """Kernels of ``steps`` replays: per-step busy time, span, gaps, kernel count, and per group /
    kernel."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    token = torch.zeros(dec.tokens.shape[0], dtype=torch.long, device=device)
    with profile(activities=acts) as prof:
        for _ in range(steps):
            dec.step(token)
            sync(device)
    kernels = device_kernels(prof)
    if not kernels:  # CPU: no device trace
        return {"kernels_per_step": None}
    per_step = split_steps(kernels, steps)
    busy = [sum(d for _, _, d in ks) for ks in per_step]
    span = [ks[-1][1] + ks[-1][2] - ks[0][1] for ks in per_step]
    groups, names = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    for name, _, d in kernels:
        for table, key in ((groups, group_of(name)), (names, name[:90])):
            table[key][0] += 1
            table[key][1] += d
    n = len(per_step)
    return {
        "kernels_per_step": len(kernels) / n,
        "busy_ms": statistics.median(busy) / 1e3,
        "span_ms": statistics.median(span) / 1e3,
        "gaps_ms": statistics.median(s - b for s, b in zip(span, busy)) / 1e3,
        "groups": {g: {"kernels": c / n, "ms": t / n / 1e3} for g, (c, t) in
                   sorted(groups.items(), key=lambda kv: -kv[1][1])},
        "top": [{"kernel": k, "per_step": c / n,
                 "us_total": round(t / n, 1), "us_mean": round(t / c, 2)}
                for k, (c, t) in sorted(names.items(), key=lambda kv: -kv[1][1])[:20]],
    }


@torch.inference_mode()
def tiled(cache: HypeNetCache, context: int, room: int) -> HypeNetCache:
    """A cache of ``context`` tokens (+ ``room``) whose attention layers hold ``cache``'s keys and
    values repeated (the last copy cut short) and whose RNN states are ``cache``'s."""
    T = cache.seen_tokens
    out = HypeNetCache(len(cache.layers), reserve_tokens=room, max_cache_len=context + room)
    for i, entry in enumerate(cache.layers):
        if not isinstance(entry, tuple):
            out.layers[i] = entry
            continue
        for start in range(0, context, T):  # [1, T, Hkv, D] tiles into one [1, room, Hkv, D]
            n = min(T, context - start)
            out.append_kv(i, entry[0][:, :n], entry[1][:, :n])
    out.seen_tokens = context
    return out


@torch.inference_mode()
def prefilled(model, context: int, args, device, room: int):
    """``(cache, next token [1], eager next-step logits [1, V] fp32, saved RNN states)`` after a
    chunked prefill of random ids (of ``args.tile`` of them, ``tiled`` up to ``context``); the
    cache is rewound to ``context`` tokens."""
    T = min(args.tile or context, context)
    _, cache, token, _ = prefill(model, T, args.chunk, device, room)
    if T < context:
        cache = tiled(cache, context, room)
    saved = [s.clone() for s in rnn_states(cache)]
    ref = model(token.view(1, 1), cache=cache, use_cache=True).logits[:, -1].float()
    rewind(cache, context, saved)
    return cache, token.view(1), ref, saved


def measure(name, model, context, args, device) -> list[dict]:
    rows = []
    bound = step_bytes(model, context, args.batch)
    bound_ms = bound["total_GB"] * 1e9 / args.bandwidth * 1e3
    room = args.steps + args.profiled + 12
    dtype = next(model.parameters()).dtype
    token = torch.zeros(args.batch, dtype=torch.long, device=device)
    if args.prefill:
        cache, token, ref, saved = prefilled(model, context, args, device, room)
    runs = [(v, None) for v in args.variants]
    if args.launch_settings is not None:
        runs += [(f"{v}+tuned", args.launch_settings) for v in args.variants]
    for variant, settings in runs:
        if args.prefill:
            with torch.inference_mode():  # the prefill's tensors are inference tensors
                rewind(cache, context, saved)
        else:
            cache = random_cache(model, context, device, dtype, room, rows=args.batch)
        with (launch_settings(settings) if settings else contextlib.nullcontext()):
            t0 = time.perf_counter()
            dec = StaticDecoder(model, cache,
                                DecodeOptions(**VARIANTS[variant.removesuffix("+tuned")]))
            setup_s = time.perf_counter() - t0
            if dec.gemv_report:  # the GEMV's per-shape choice against cuBLAS (µs per weight)
                print_table([{"shape": k, **{f: v[f] for f in ("choice", "weights", "us",
                                                              "cublas_us", "tb_per_s",
                                                              "cublas_tb_per_s")}}
                             for k, v in dec.gemv_report.items()], f"{name}: GEMV vs cuBLAS")
            # the step right after the prompt (after a prefill: vs eager)
            first = dec.step(token).float().clone()
            err = float((first - ref).norm() / ref.norm()) if args.prefill else None
            ms = timed(dec, args.steps, device)
            prof = profile_steps(dec, args.profiled, device)
        rows.append({"model": name, "batch": args.batch, "context": context, "variant": variant,
                     "step_ms": ms, "bound_ms": bound_ms, "vs_bound": ms / bound_ms,
                     "setup_s": round(setup_s, 1), "graph": dec.graph is not None,
                     "error": dec.graph_error or dec.compile_error, "rel_err_vs_eager": err,
                     "tile": args.tile,
                     "gemv": dec.gemv_report, **bound, **prof})
        del dec
        if not args.prefill:
            del cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def report(rows: list[dict]) -> None:
    print_table([{k: r.get(k) for k in ("model", "batch", "context", "variant", "step_ms",
                                        "bound_ms", "vs_bound", "rel_err_vs_eager",
                                        "kernels_per_step", "busy_ms", "span_ms", "gaps_ms",
                                        "total_GB")}
                 for r in rows], "decode step: wall, bytes bound, kernels (per token)")
    for r in rows:
        if not r.get("groups"):
            continue
        title = f"{r['model']} @ {r['context']} ({r['variant']}): kernel time by group, per token"
        print_table([{"group": g, "kernels": v["kernels"], "ms": v["ms"]}
                     for g, v in r["groups"].items()], title)
        print_table(r["top"], f"{r['model']} @ {r['context']} ({r['variant']}): costliest kernels")


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.bandwidth = decode_bandwidth(args.bandwidth)
    device = torch.device("cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    configs = model_configs(args.cpu_smoke)
    rows = []
    for name in args.models:
        model = build(configs[name], device, dtype)
        # Triton compiles / autotunes untimed
        warm = random_cache(model, 256, device, dtype, 16, rows=args.batch)
        StaticDecoder(model, warm).step(torch.zeros(args.batch, dtype=torch.long, device=device))
        del warm
        for context in args.contexts:
            rows += measure(name, model, context, args, device)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report(rows)
    tokens_per_s = {f"{r['model']}@{r['context']}/{r['variant']}": r["batch"] / r["step_ms"] * 1e3
                    for r in rows}
    payload = {"rows": rows, "tokens_per_s": tokens_per_s, "bandwidth_Bps": args.bandwidth,
               "command": " ".join(sys.argv)}
    print(f"\nwrote {write_result('decode_profile', payload, args.out)}")
    return payload


if __name__ == "__main__":
    main()
