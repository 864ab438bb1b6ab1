"""``x @ W.T (+ b)`` for a decode step's few rows: a Triton GEMV for the static decode step
(``static_decode.py``).

At batch 1 a decode step is a chain of GEMVs whose time is the time to read the weights. cuBLAS
picks GEMM tiles for them (64-row tiles on an H200), so a 2048 x 2048 projection fills about a
quarter of the SMs: a kernel profile of HypeNet-2B's 512K step measured the 8 MB q/k/v/o weights
read at ~1.3 TB/s and the 25 MB MLP ones at ~2.3 TB/s, against ~4.4 TB/s that the split-KV
attention reaches in the same step. Here each program reads a ``[BLOCK_N, BLOCK_K]`` tile of W at
a time for ``BLOCK_N`` output features, so a 2048-row weight is spread over hundreds of programs
and every SM has several tiles in flight.

* ``decode_linear(x, weight, bias, gemv=True)``: the kernel for CUDA inputs of at most
  ``MAX_ROWS`` rows (flattened) in bf16/fp16, ``F.linear`` otherwise (CPU, training, batched
  rollouts, where cuBLAS's GEMM is the right tool).
* ``gemv_triton``: the kernel itself, with explicit tile sizes (``TRITON_INTERPRET=1`` runs it on
  CPU fp32 tensors, which is how the CPU tests check it).
* ``tune_gemv``: times a few tile choices per weight shape on the device and keeps the fastest;
  ``StaticDecoder`` calls it before its warm-up, outside any compiled or captured code.
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

# rows (flattened batch x tokens) up to which the GEMV replaces cuBLAS: each row is one more
# multiply-add per weight element the program has already loaded
MAX_ROWS = 4
# (BLOCK_N, BLOCK_K, num_warps) tried by ``tune_gemv``; the first is used untuned
CANDIDATES = ((4, 1024, 4), (2, 2048, 4), (4, 2048, 8), (8, 512, 4), (8, 1024, 8), (16, 256, 4),
              (1, 2048, 4), (16, 512, 8))
# (N, K, rows, dtype, device index) -> (BLOCK_N, BLOCK_K, num_warps), filled by ``tune_gemv``
_TUNED: dict = {}


if _HAS_TRITON:

    @triton.jit
    def _gemv_kernel(X, W, Bias, Y, N, stride_xm, stride_wn, stride_ym,
                     K: tl.constexpr, M: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
        """One program: output features [pid * BLOCK_N, +BLOCK_N) of all M rows; K is a constexpr
        so the loop over it has a compile-time bound (unrolled, and runnable by the interpreter)."""
        pid = tl.program_id(0)
        offs_n = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BLOCK_N]
        offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
        n_ok = offs_n < N
        m_ok = offs_m < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            k_ok = offs_k < K
            w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
            x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            # [BLOCK_M, 1, BLOCK_K] * [1, BLOCK_N, BLOCK_K] summed over K -> [BLOCK_M, BLOCK_N]
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                block_n: int = 4, block_k: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """x ``[..., K]`` (at most ``MAX_ROWS`` rows once flattened), weight ``[N, K]`` (rows
    contiguous), bias ``[N]`` -> ``[..., N]`` in x's dtype, accumulated in fp32."""
    K = x.shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(-1, K)  # [..., K] -> [M, K]
    M = x2.shape[0]
    if M > MAX_ROWS or weight.shape[1] != K or weight.stride(1) != 1 or x2.stride(1) != 1:
        raise ValueError(f"gemv_triton needs <= {MAX_ROWS} rows and unit-stride rows: x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}")
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    block_k = min(block_k, triton.next_power_of_2(K))
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x2, weight, bias if bias is not None else weight, y, N,
        x2.stride(0), weight.stride(0), y.stride(0),
        K=K, M=M, BLOCK_M=max(1, triton.next_power_of_2(M)), BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, num_warps=num_warps,
    )
    return y.view(*x.shape[:-1], N)  # [M, N] -> [..., N]


def _key(x: torch.Tensor, weight: torch.Tensor) -> tuple:
    return (weight.shape[0], weight.shape[1], x.numel() // x.shape[-1], x.dtype,
            x.device.index)


def uses_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``decode_linear`` sends this product to the Triton kernel."""
    return (_HAS_TRITON and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.numel() // x.shape[-1] <= MAX_ROWS
            and weight.stride(1) == 1 and x.stride(-1) == 1)


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  gemv: bool = True) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; through the GEMV kernel (the tiles ``tune_gemv`` chose for
    this shape, else the first candidate) when ``gemv`` and ``uses_gemv``."""
    if not (gemv and uses_gemv(x, weight)):
        return F.linear(x, weight, bias)
    block_n, block_k, warps = _TUNED.get(_key(x, weight), CANDIDATES[0])
    return gemv_triton(x, weight, bias, block_n, block_k, warps)


def _time_ms(fn, reps: int) -> float:
    """Median of ``reps`` CUDA-event timings of ``fn``."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def tune_gemv(weights: list[torch.Tensor], rows: int, reps: int = 10) -> dict:
    """For every distinct weight shape in ``weights`` (that ``uses_gemv`` would take at ``rows``
    rows), time each of ``CANDIDATES`` and keep the fastest for ``decode_linear``. Each timing runs
    the product once over every weight of that shape, as a decode step does: the weights then come
    from memory, not from the L2 cache that one repeated weight would sit in. Returns
    ``{(N, K): {"config", "us", "cublas_us", "tb_per_s", "cublas_tb_per_s"}}`` per weight, for the
    shapes tuned now (shapes tuned before are skipped)."""
    groups: dict = {}
    for w in weights:
        x = torch.randn(rows, w.shape[1], device=w.device, dtype=w.dtype)
        if uses_gemv(x, w) and _key(x, w) not in _TUNED:
            groups.setdefault(_key(x, w), (x, []))[1].append(w)
    report = {}
    for key, (x, group) in groups.items():
        def run(cfg, group=group, x=x):
            for w in group:
                gemv_triton(x, w, None, *cfg)

        def run_cublas(group=group, x=x):
            for w in group:
                F.linear(x, w)

        timings = {}
        for cfg in CANDIDATES:
            run(cfg)  # compiles
            timings[cfg] = _time_ms(lambda cfg=cfg: run(cfg), reps) / len(group)
        best = min(timings, key=timings.get)
        _TUNED[key] = best
        run_cublas()
        cublas = _time_ms(run_cublas, reps) / len(group)
        nbytes = group[0].numel() * group[0].element_size()
        report[key[:2]] = {"config": best, "us": timings[best] * 1e3, "cublas_us": cublas * 1e3,
                           "tb_per_s": nbytes / timings[best] / 1e9,
                           "cublas_tb_per_s": nbytes / cublas / 1e9}
    return report
