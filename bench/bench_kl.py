"""Benchmark: fused chunked KL (halo_dist.losses) vs naive full-logits KL.

Default shape = stage 3 of HypeNet-2B on one GPU: 16,384 tokens x 151,936 vocab, hidden 2048
(student and teacher), bf16. For every backend (naive = full [N, V] logits upcast to fp32;
torch = our chunked autograd function; compiled = the same with each chunk's divergence fused by
torch.compile; triton = the same chunks through our Triton kernel, CUDA only) it measures
forward+backward time and peak memory above the inputs, and the agreement of loss and gradients
with the naive path. A second section checks every option (forward/reverse KL, temperature, mask,
CE term) of each fused backend against a float64 full-logits reference on a token subset.

Prints a table and writes JSON (default ``bench/results/kl.json``) with top-level
``kl_peak_mem_ratio`` = peak extra memory of the fused backend that ``backend="auto"`` picks,
divided by the naive path's.

  python bench/bench_kl.py                 # on the GPU
  python bench/bench_kl.py --cpu-smoke     # tiny shapes on CPU (aten-level memory tracking)
  # a SmolLM2-size stage-2 step's loss: eager vs compiled chunks
  python bench/bench_kl.py --tokens 65536 --vocab 49152 --hidden 576 --chunk-size 8192 \
      --backends naive,torch,compiled
  # one chunk's divergence and gradient from its logits alone: compiled vs the triton kernel at
  # a few launch settings, in ms and GB/s of one read of both logits and one bf16 gradient write
  python bench/bench_kl.py --chunk-kernels --chunk-size 4096
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata as md
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import sync  # noqa: E402
from halo_dist.losses import fused_distill_loss, naive_distill_loss  # noqa: E402
from halo_dist.losses.kl import _pick_backend, resolve_beta, triton_applies  # noqa: E402
from halo_dist.losses.memtrack import LiveBytes  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16_384)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--hidden", type=int, default=2048, help="student hidden size Ds")
    p.add_argument("--teacher-hidden", type=int, default=None, help="Dt (default: = Ds)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--direction", choices=("forward", "reverse"), default="forward")
    p.add_argument("--backends", default="naive,torch,compiled,triton")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="fused backends (default: from budget)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--check-tokens", type=int, default=1024,
                   help="token subset for the fp64 checks")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/kl.json)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, JSON to /tmp")
    p.add_argument("--chunk-kernels", action="store_true",
                   help="only the per-chunk kernels (compiled vs triton launch settings), CUDA")
    a = p.parse_args(argv)
    if a.cpu_smoke:
        a.tokens, a.vocab, a.hidden, a.warmup, a.iters, a.check_tokens = 256, 2048, 64, 1, 2, 64
        a.out = a.out or "/tmp/halo_dist_kl_cpu_smoke.json"
    a.out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "kl.json")
    a.teacher_hidden = a.teacher_hidden or a.hidden
    return a


def make_inputs(a, device, n=None, seed=0):
    """Student close to the teacher (as in distillation, where the KL is small and cancellation in
    low precision hurts most). Logit std ~2.3 (lm_head std 0.05, unit-variance hidden states)."""
    n = n or a.tokens
    g = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    dtype = DTYPES[a.dtype]
    t_h, t_w = rnd(n, a.teacher_hidden), rnd(a.vocab, a.teacher_hidden) * 0.05
    if a.teacher_hidden == a.hidden:
        s_h, s_w = t_h + 0.3 * rnd(n, a.hidden), t_w + 0.01 * rnd(a.vocab, a.hidden)
    else:
        s_h, s_w = rnd(n, a.hidden), rnd(a.vocab, a.hidden) * 0.05
    mask = torch.rand(n, generator=g) > 0.1
    labels = torch.randint(0, a.vocab, (n,), generator=g)
    labels[::7] = -100
    cast = lambda x, grad=False: x.to(device, dtype).requires_grad_(grad)  # noqa: E731
    return (cast(s_h, True), cast(s_w, True), cast(t_h), cast(t_w), mask.to(device),
            labels.to(device))


def loss_fn(backend, a):
    """(s_h, s_w, t_h, t_w, **kw) -> DistillLossOutput for one backend name."""
    if backend == "naive":
        return lambda *x, **kw: naive_distill_loss(*x, direction=a.direction, **kw)
    return lambda *x, **kw: fused_distill_loss(*x, direction=a.direction, backend=backend,
                                               chunk_size=a.chunk_size, **kw)


def step(fn, inputs):
    """One forward+backward; returns (loss value, grad of hidden, grad of weight)."""
    s_h, s_w, t_h, t_w = inputs
    s_h.grad = s_w.grad = None
    out = fn(s_h, s_w, t_h, t_w)
    out.loss.backward()
    return out.loss.detach(), s_h.grad, s_w.grad


def measure(fn, inputs, a, device):
    """Timing (ms per fwd+bwd, median) and peak memory above the inputs (bytes)."""
    for _ in range(a.warmup):  # Triton JIT / autotune happens here
        step(fn, inputs)
    times = []
    for _ in range(a.iters):
        sync(device)
        t0 = time.perf_counter()
        step(fn, inputs)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    for x in inputs:
        x.grad = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        res = step(fn, inputs)
        peak = torch.cuda.max_memory_allocated() - base
    else:
        with LiveBytes(inputs) as m:
            res = step(fn, inputs)
        peak = m.peak
    return sorted(times)[len(times) // 2], peak, res


def rel(a, b):
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def main_table(a, device, backends):
    """Full-size timing / memory / agreement with the naive path."""
    s_h, s_w, t_h, t_w, _, _ = make_inputs(a, device)
    inputs = [s_h, s_w, t_h, t_w]
    rows, ref = {}, None
    for b in backends:
        try:
            ms, peak, (loss, g_h, g_w) = measure(loss_fn(b, a), inputs, a, device)
        except torch.OutOfMemoryError as e:  # the naive path may not fit: that is the point
            rows[b] = {"error": f"OOM: {str(e).splitlines()[0]}"}
            continue
        row = {"ms_fwd_bwd": ms, "peak_extra_bytes": peak, "loss": loss.item(),
               "tokens_per_s": a.tokens / ms * 1e3}
        if ref is None and b == "naive":
            ref = (loss, g_h.clone(), g_w.clone())
        elif ref is not None:
            row.update(loss_rel_err_vs_naive=abs(loss.item() - ref[0].item()) / abs(ref[0].item()),
                       grad_hidden_rel_err_vs_naive=rel(g_h, ref[1]),
                       grad_weight_rel_err_vs_naive=rel(g_w, ref[2]))
        rows[b] = row
        del loss, g_h, g_w
    return rows


CHECKS = [dict(direction=d, temperature=T, masked=m, ce=c)
          for d in ("forward", "reverse") for T in (1.0, 2.0)
          for m, c in ((False, False), (True, True))]


def option_checks(a, device, backends):
    """Every option of each fused backend vs a float64 full-logits reference on a token subset."""
    s_h, s_w, t_h, t_w, mask, labels = make_inputs(a, device, n=a.check_tokens, seed=1)
    ref_in = [x.detach().double().requires_grad_(x.requires_grad) for x in (s_h, s_w, t_h, t_w)]
    results = []
    for c in CHECKS:
        kw = dict(direction=c["direction"], temperature=c["temperature"],
                  ce_weight=0.5 if c["ce"] else 0.0, token_mask=mask if c["masked"] else None,
                  labels=labels if c["ce"] else None)
        ref = naive_distill_loss(*ref_in, **kw)
        rg = torch.autograd.grad(ref.loss, ref_in[:2])
        for b in backends:
            out = (naive_distill_loss(s_h, s_w, t_h, t_w, upcast=False, **kw) if b == "naive_lowp"
                   else fused_distill_loss(s_h, s_w, t_h, t_w, backend=b, **kw))
            g = torch.autograd.grad(out.loss, [s_h, s_w])
            results.append(
                {**c, "backend": b,
                 "loss_rel_err": abs(out.loss.item() - ref.loss.item()) / abs(ref.loss.item()),
                 "grad_hidden_rel_err": rel(g[0], rg[0]), "grad_weight_rel_err": rel(g[1], rg[1])})
    return results


TRITON_LAUNCHES = [dict(block=b, num_warps=w) for b, w in
                   ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16))]


def chunk_kernel_table(a, device) -> list[dict]:
    """One chunk's KL (forward or reverse, T = 1) and bf16 gradient from fp32 logits of shape
    [chunk_size, vocab]: the compiled function and the triton kernel at each launch setting, in
    the same process; GB/s counts one read of both logits and one write of the gradient (the
    kernel reads them twice: its floor is half that figure)."""
    from halo_dist.losses import _triton_kl
    from halo_dist.losses._chunked import compiled_chunk_grad

    c, v = a.chunk_size or 4096, a.vocab
    g = torch.Generator(device=device).manual_seed(0)
    tz = torch.randn(c, v, device=device, generator=g) * 2.3
    z = tz + 0.3 * torch.randn(c, v, device=device, generator=g)
    beta = 0.0 if a.direction == "forward" else 1.0
    kf, cf = torch.tensor(1e-4, device=device), torch.tensor(0.0, device=device)
    args = (z, tz, None, kf, cf, 1.0, -100, beta, torch.bfloat16)
    one_pass = c * v * (4 + 4 + 2)
    rows, ref = [], None

    def time_it(fn):
        for _ in range(a.warmup + 1):
            out = fn(*args)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(a.iters):
            out = fn(*args)
        sync(device)
        return (time.perf_counter() - t0) / a.iters * 1e3, out

    shipped = dict(_triton_kl.LAUNCH)
    variants = [("compiled", None)] + [("triton", launch) for launch in TRITON_LAUNCHES]
    for name, launch in variants:
        if launch is not None:
            _triton_kl.LAUNCH.update(launch)
        ms, (kl, _, grad) = time_it(compiled_chunk_grad if launch is None
                                    else _triton_kl.chunk_grad_triton)
        row = {"kernel": name, **(launch or {}), "ms": ms, "gb_per_s_one_pass": one_pass / ms / 1e6}
        if ref is None:
            ref = (kl.clone(), grad.float())
        else:
            row.update(kl_rel_err=rel(kl, ref[0]), grad_rel_err=rel(grad.float(), ref[1]))
        rows.append(row)
        del kl, grad
    _triton_kl.LAUNCH.clear()
    _triton_kl.LAUNCH.update(shipped)
    print(f"\none chunk's {a.direction} KL + bf16 gradient from fp32 logits [{c}, {v}]")
    print(f"{'kernel':9} {'block':>6} {'warps':>5} {'ms':>8} {'GB/s 1x':>8} {'kl err':>9} "
          f"{'grad err':>9}")
    for r in rows:
        e = lambda k: f"{r[k]:9.2e}" if k in r else f"{'-':>9}"  # noqa: E731
        print(f"{r['kernel']:9} {r.get('block', '-'):>6} {r.get('num_warps', '-'):>5} "
              f"{r['ms']:8.3f} {r['gb_per_s_one_pass']:8.0f} {e('kl_rel_err')} {e('grad_rel_err')}")
    return rows


def versions():
    v = {"python": platform.python_version(), "torch": torch.__version__,
         "cuda": torch.version.cuda}
    for pkg in ("triton",):
        try:
            v[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            v[pkg] = None
    return v


def print_report(a, rows, checks):
    gib = 1 << 30
    print(f"\nKL fwd+bwd, {a.tokens} tokens x V={a.vocab}, Ds={a.hidden}, Dt={a.teacher_hidden}, "
          f"{a.dtype}, {a.direction} KL")
    print(f"{'backend':8} {'ms':>9} {'tok/s':>11} {'peak GiB':>9} {'loss':>14} {'dloss':>9} "
          f"{'dgrad_h':>9} {'dgrad_W':>9}")
    for b, r in rows.items():
        if "error" in r:
            print(f"{b:8} {r['error']}")
            continue
        e = lambda k: f"{r[k]:9.2e}" if k in r else f"{'-':>9}"  # noqa: E731
        print(f"{b:8} {r['ms_fwd_bwd']:9.2f} {r['tokens_per_s']:11.0f} "
              f"{r['peak_extra_bytes'] / gib:9.3f} {r['loss']:14.6g} {e('loss_rel_err_vs_naive')} "
              f"{e('grad_hidden_rel_err_vs_naive')} {e('grad_weight_rel_err_vs_naive')}")
    print(f"\noption checks vs float64 reference on {a.check_tokens} tokens (relative errors)")
    print(f"{'dir':8} {'T':>4} {'mask+ce':>7} {'backend':10} {'loss':>9} {'grad_h':>9} "
          f"{'grad_W':>9}")
    for c in checks:
        print(f"{c['direction']:8} {c['temperature']:4} {str(c['ce']):>7} {c['backend']:10} "
              f"{c['loss_rel_err']:9.2e} {c['grad_hidden_rel_err']:9.2e} "
              f"{c['grad_weight_rel_err']:9.2e}")


def main(argv=None):
    a = parse_args(argv)
    torch.manual_seed(0)
    device = torch.device("cpu" if a.cpu_smoke or not torch.cuda.is_available() else "cuda")
    if a.cpu_smoke:
        torch.set_num_threads(1)
    if a.chunk_kernels:
        if device.type != "cuda":
            raise SystemExit("--chunk-kernels times CUDA kernels: run it on a GPU")
        rows = chunk_kernel_table(a, device)
        result = {"device": torch.cuda.get_device_name(), "versions": versions(),
                  "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  "config": {k: v for k, v in vars(a).items() if k != "out"},
                  "chunk_kernels": rows}
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {a.out}")
        return result
    wanted = [b for b in a.backends.split(",") if b]
    beta, dtype = resolve_beta(a.direction, None), DTYPES[a.dtype]
    if "triton" in wanted and not triton_applies(device, beta, dtype):
        print(f"the triton kernel does not run on {device.type}: skipping the triton backend")
        wanted.remove("triton")
    auto = _pick_backend("auto", device, a.tokens, beta, dtype)
    rows = main_table(a, device, wanted)
    checks = option_checks(a, device, [b for b in wanted if b != "naive"] + ["naive_lowp"])
    print_report(a, rows, checks)
    ratio = {b: r["peak_extra_bytes"] / rows["naive"]["peak_extra_bytes"]
             for b, r in rows.items() if b != "naive" and "error" not in r
             and "error" not in rows.get("naive", {"error": 1})}
    result = {
        "kl_peak_mem_ratio": ratio.get(auto),
        "kl_peak_mem_ratio_backend": auto,
        "kl_peak_mem_ratio_by_backend": ratio,
        "device": torch.cuda.get_device_name() if device.type == "cuda"
        else f"cpu ({platform.processor() or 'unknown'})",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "memory_measure": "torch.cuda.max_memory_allocated above inputs" if device.type == "cuda"
        else "aten-level live storages (halo_dist.losses.memtrack), CPU smoke only",
        "config": {k: v for k, v in vars(a).items() if k != "out"},
        "results": rows,
        "option_checks": checks,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nkl_peak_mem_ratio ({auto} / naive) = {result['kl_peak_mem_ratio']}; wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
