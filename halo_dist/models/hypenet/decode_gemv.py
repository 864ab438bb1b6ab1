"""``x @ W.T (+ b)`` for a batch-1 decode step: a Triton GEMV, used per weight shape only where it
beats cuBLAS on the device at hand.

At batch 1 a decode step is a chain of GEMVs, each as fast as its weight can be read. cuBLAS runs
them with GEMM tiles 64 output rows tall: a 2048 x 2048 W_o is 32 tiles on an H200's 132 SMs. A
kernel profile of HypeNet-2B's 512K step measured W_o's 8.4 MB read at 1.3 TB/s, the 25 MB MLP
down projection at 2.3 TB/s (split-K plus a reduction kernel) and the packed input projections at
2.4-3.2 TB/s, against the ~4.4 TB/s the attention kernel reaches in the same step; together about
0.45 ms of a 5.3 ms token. Here a program owns ``BLOCK_N`` output rows and reads their whole K in
``BLOCK_K`` chunks, the chunk loop unrolled so that every load can be in flight at once, and a
2048-row weight is spread over hundreds of programs.

An earlier Triton GEMV (a runtime loop over K, one chunk in flight per program) read at ~2.2 TB/s
and lost to cuBLAS on every shape. So nothing here is assumed: ``tune_gemv`` times every candidate
tile and cuBLAS itself per weight shape, over all the weights of that shape in turn (as a step reads
them, from DRAM), and ``decode_linear`` takes the kernel only for shapes where it won.

* ``gemv_triton``: the kernel (``TRITON_INTERPRET=1`` runs it on CPU tensors: the CPU tests).
* ``tune_gemv``: the per-shape choice; ``StaticDecoder`` runs it for a batch-1 decoder on CUDA
  before its warm-up, outside any compiled or captured code.
* ``decode_linear``: the kernel where the choice says so, ``F.linear`` elsewhere.
  On by default for batch-1 decoders on CUDA; ``DecodeOptions(gemv=False)`` keeps cuBLAS
  everywhere. In HypeNet-2B's compiled 512K step the
  kernel won on every weight shape and took the step from 5.25 to 5.15 ms on an H200 (7.05 to
  6.93 on an H100), the teacher shape's from 15.34 to 15.12 ms (H100: 21.99 either way); the
  tuning itself runs once per process and weight shape.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    _HAS_TRITON = False

# (BLOCK_N, BLOCK_K, num_warps) timed by ``tune_gemv``: from many small programs (1 row, the whole
# K of a 2048-wide weight) to fewer, taller ones
CANDIDATES = ((1, 2048, 4), (2, 1024, 4), (2, 2048, 8), (4, 512, 4), (4, 1024, 4), (4, 2048, 8),
              (8, 512, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 8))
# (N, K, dtype, device index) -> (BLOCK_N, BLOCK_K, num_warps), or None where cuBLAS won. A
# compiled step guards on it: tune before compiling (``StaticDecoder`` does), or the step recompiles
_CHOICE: dict = {}
# what ``tune_gemv`` reads before each timing so that no weight is still in L2 (an H200 has 50 MB)
_L2_EVICT_BYTES = 256 << 20
if _HAS_TRITON:

    @triton.jit
    def _gemv_kernel(X, W, Bias, Y, N, stride_wn, K: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
        """One program: outputs [pid * BLOCK_N, +BLOCK_N) of one row x ``[K]``. The chunk loop is
        unrolled (K is a constexpr) and the products are summed over K only at the end, so no
        chunk's load waits for the previous chunk's arithmetic."""
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        n_ok = offs_n < N
        rows = W + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1] row starts
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            k_ok = offs_k < K
            # [BLOCK_N, BLOCK_K]: streamed once, so it should not push other data out of L2
            w = tl.load(rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
            x = tl.load(X + offs_k, mask=k_ok, other=0.0)  # [BLOCK_K]
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)  # [BLOCK_N]
        if HAS_BIAS:
            y += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=n_ok)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                block_n: int = 4, block_k: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """x ``[..., K]`` holding one row, weight ``[N, K]`` (unit-stride rows), bias ``[N]`` ->
    ``[..., N]`` in x's dtype, accumulated in fp32."""
    K, N = x.shape[-1], weight.shape[0]
    if x.numel() != K or weight.shape[1] != K or weight.stride(1) != 1:
        raise ValueError(f"gemv_triton needs one row and unit-stride weight rows: x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}")
    x1 = x.reshape(K)  # [..., K] -> [K]
    y = torch.empty(N, device=x.device, dtype=x.dtype)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x1, weight, bias if bias is not None else weight, y, N, weight.stride(0),
        K=K, BLOCK_N=block_n, BLOCK_K=min(block_k, triton.next_power_of_2(K)),
        HAS_BIAS=bias is not None, num_warps=num_warps,
    )
    return y.view(*x.shape[:-1], N)  # [N] -> [..., N]


def _key(x: torch.Tensor, weight: torch.Tensor) -> tuple:
    return (weight.shape[0], weight.shape[1], weight.dtype, x.device.index)


def kernel_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel can take this product: one row on CUDA, bf16/fp16, unit strides."""
    return (_HAS_TRITON and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.numel() == x.shape[-1]
            and weight.stride(1) == 1 and x.stride(-1) == 1)


def decode_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: through the kernel with the tile ``tune_gemv`` chose where it
    beat cuBLAS for this weight shape on this device, else cuBLAS."""
    cfg = _CHOICE.get(_key(x, weight)) if kernel_fits(x, weight) else None
    if cfg is None:
        return F.linear(x, weight, bias)
    return gemv_triton(x, weight, bias, *cfg)


def graph_time_ms(fn, calls: int = 1, reps: int = 5) -> float:
    """Milliseconds per call of ``fn`` (CUDA): ``calls`` back-to-back calls captured in one CUDA
    graph, the median of ``reps`` replays. A decode step replays its kernels from a graph too;
    launched one by one from Python, few-µs kernels would be timed at the host's launch rate."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compilation, allocations
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def _shape_groups(weights: list[torch.Tensor]) -> dict:
    """{key: (x, [weights])} for the weights the kernel fits and no choice exists for yet."""
    groups: dict = {}
    for w in weights:
        x = torch.randn(1, w.shape[1], device=w.device, dtype=w.dtype)
        if kernel_fits(x, w) and _key(x, w) not in _CHOICE:
            groups.setdefault(_key(x, w), (x, []))[1].append(w)
    return groups


@torch.inference_mode()
def tune_gemv(weights: list[torch.Tensor], reps: int = 11, min_gain: float = 1.03) -> dict:
    """Choose, per distinct weight shape among ``weights``, between cuBLAS and each of
    ``CANDIDATES``; the choice is kept for ``decode_linear``. A timing replays the product once
    over every weight of the shape in turn, as a decode step reads them, after a read that
    evicts L2 (its own time subtracted): the weights come from DRAM, as in the step, even for a
    shape with a single small weight. The kernel is taken only when its best tile beats cuBLAS by
    ``min_gain`` and its result is within bf16 rounding of cuBLAS's. Returns ``{"NxK":
    {"choice", "us", "cublas_us", "tb_per_s", "cublas_tb_per_s", "candidates_us"}}`` (µs per
    weight) for the shapes chosen now."""
    report = {}
    groups = _shape_groups(weights)
    if not groups:
        return report
    device = next(iter(groups.values()))[1][0].device
    # a read, not a write: evicting clean lines costs the timed kernels nothing
    flush = torch.zeros(_L2_EVICT_BYTES // 4, device=device, dtype=torch.float32)
    total = torch.zeros((), device=device, dtype=torch.float32)

    def evict():
        torch.sum(flush, dim=0, out=total)

    flush_ms = graph_time_ms(evict, reps=reps)
    for key, (x, group) in groups.items():
        def run(cfg, group=group, x=x):
            evict()
            for w in group:
                gemv_triton(x, w, None, *cfg) if cfg else F.linear(x, w)

        want = F.linear(x, group[0]).float()
        per = {}
        for cfg in (None,) + CANDIDATES:
            got = gemv_triton(x, group[0], None, *cfg).float() if cfg else want
            if cfg is None or float((got - want).norm() / want.norm().clamp_min(1e-30)) < 2e-2:
                ms = graph_time_ms(lambda cfg=cfg: run(cfg), reps=reps) - flush_ms
                per[cfg] = max(ms, 1e-6) * 1e3 / len(group)
        best = min((c for c in per if c is not None), key=per.get, default=None)
        if best is not None and per[None] / per[best] < min_gain:
            best = None
        _CHOICE[key] = best
        report[f"{key[0]}x{key[1]}"] = _report_row(group, best, per)
    return report


def _report_row(group: list[torch.Tensor], best, per: dict) -> dict:
    nbytes = group[0].numel() * group[0].element_size()
    return {"choice": "cublas" if best is None else list(best), "weights": len(group),
            "us": per[best], "cublas_us": per[None], "tb_per_s": nbytes / per[best] / 1e6,
            "cublas_tb_per_s": nbytes / per[None] / 1e6,
            "candidates_us": {str(list(c)): round(t, 2) for c, t in per.items() if c}}
