"""Single-token GQA attention over a fixed-size KV buffer whose valid length lives on the device.

This is the attention of the static (CUDA-graph) decode step (``static_decode.py``): the cache is a
preallocated ``[B, room, Hkv, D]`` buffer and the number of valid keys is a device tensor, so one
captured graph serves every decode position without a host sync or a shape change.

* ``decode_attention_torch``: the exact reference (fp32 softmax over the masked buffer); CPU and
  tests.
* ``decode_attention_triton``: split-KV ("flash-decoding") Triton kernel for CUDA. A decode step has
  one query per head, so one program per (batch, head) would leave most SMs idle while reading GBs
  of keys at 512K context; the keys are split into ``num_splits`` ranges read in parallel, each
  program serving all G query heads of its KV head (keys and values are read once per group, in the
  cache's own layout, no repeat), and a small torch reduction merges the partial softmaxes.

``decode_attention`` dispatches: the kernel on CUDA, the reference elsewhere.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    _HAS_TRITON = False


def decode_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor,
                           scale: float, start: torch.Tensor | None = None) -> torch.Tensor:
    """q ``[B, 1, H, D]``, k/v ``[B, room, Hkv, D]``, length int ``[1]`` (every row) or ``[B]`` (per
    row), start int ``[B]`` (default 0): row b attends keys ``start[b] <= t < length[b]`` (``start``
    skips left padding; per-row lengths let rows of one batch sit at different positions) ->
    ``[B, 1, H, D]``. Query head h reads KV head ``h // (H / Hkv)`` (repeat_interleave
    convention)."""
    B, _, H, D = q.shape
    room, Hkv = k.shape[1], k.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    t = torch.arange(room, device=k.device)
    valid = t[None, :] < length.view(-1, 1)  # [1 or B, room]
    if start is not None:
        valid = valid & (t[None, :] >= start[:, None])  # [B, room]
    valid = valid[:, None, None, :]  # [B, 1, 1, room] over [B, Hkv, G, room]
    qg = q.reshape(B, Hkv, H // Hkv, D).to(acc)  # [B, 1, H, D] -> [B, Hkv, G, D]
    scores = torch.einsum("bhgd,bthd->bhgt", qg, k.to(acc)) * scale  # [B, Hkv, G, room]
    probs = scores.masked_fill(~valid, float("-inf")).softmax(-1)
    # the buffer past ``length`` is uninitialised memory (NaN bit patterns included): 0 * NaN = NaN
    v = v.to(acc).masked_fill(~valid[:, 0, 0, :, None, None], 0.0)  # [B, room, Hkv, D]
    o = torch.einsum("bhgt,bthd->bhgd", probs, v)  # [B, Hkv, G, D]
    return o.reshape(B, 1, H, D).to(q.dtype)  # [B, Hkv, G, D] -> [B, 1, H, D]


# Launch settings of the split-KV kernel per regime (``bench/tune_decode_kernels.py`` times them on
# the device; they change the result only by the order of floating-point additions). "split": too
# few rows x KV heads to fill the GPU, so each row's keys are split across programs (long-context
# decode at small batch). "rows": a program per (row, KV head) already fills it (batched rollouts).
# "split" at 512K on an H200: 2 programs per SM, 466 us per layer against 522-532 us with 4
# (both model shapes, the whole decode step; BENCHMARKS.md).
LAUNCH = {
    "split": dict(block_n=64, num_warps=4, num_stages=3, programs_per_sm=2),
    "rows": dict(block_n=64, num_warps=4, num_stages=3, programs_per_sm=4),
}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (8 stand in for a CPU: Triton's interpreter)."""
    return (torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda" else 8)


def launch_regime(batch: int, kv_heads: int, device: torch.device) -> str:
    """``"rows"`` when one program per (row, KV head) gives four per SM, else ``"split"``."""
    return "rows" if batch * kv_heads >= 4 * sm_count(device) else "split"


def split_plan(room: int, batch: int, kv_heads: int, block_n: int,
               device: torch.device, programs_per_sm: int = 4) -> int:
    """How many programs split each (row, KV head)'s keys: about ``programs_per_sm`` programs per
    SM, at most one per ``block_n`` keys of the buffer. Fixed for a buffer (a captured graph stays
    valid); the kernel divides each row's *valid* keys among them on the device, so spare room in
    the buffer (a cache grown by doubling, the decode room ahead) leaves no program idle."""
    blocks = math.ceil(room / block_n)
    return max(1, min(blocks, math.ceil(programs_per_sm * sm_count(device)
                                        / max(1, batch * kv_heads))))


if _HAS_TRITON:

    @triton.jit
    def _split_kv_kernel(
        Q, K, V, Length, Start, O_part, M_part, L_part,
        stride_len, stride_qb, stride_qh,
        stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh,
        scale, num_splits,
        KV_HEADS: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """One program: batch b, KV head h, the ``split``-th of ``num_splits`` equal ranges (whole
        blocks) of row b's valid keys ``[start[b], length)``. Writes the unnormalised output,
        running max and sum of its G query heads (an empty range writes m = -inf, l = 0)."""
        pid_bh = tl.program_id(0)
        split = tl.program_id(1)
        b = (pid_bh // KV_HEADS).to(tl.int64)
        h = pid_bh % KV_HEADS
        length = tl.load(Length + b * stride_len)  # stride 0: one length for every row
        first = tl.load(Start + b)  # left padding of row b
        # this split's share of the valid keys, read from the device: the same graph serves every
        # length, and however large the buffer, every program has keys while there are enough
        per = tl.cdiv(tl.cdiv(length - first, num_splits), BLOCK_N) * BLOCK_N
        start = first + split * per
        end = tl.minimum(start + per, length)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        g_ok = offs_g < G
        q = tl.load(Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                    mask=g_ok[:, None], other=0.0)  # [BLOCK_G, D]
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for n in range(start, end, BLOCK_N):
            offs_n = n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < end
            # token * stride passes 2^31 beyond 2M tokens x 8 heads x 128
            offs_n = offs_n.to(tl.int64)
            k = tl.load(K + b * stride_kb + offs_n[:, None] * stride_kt + h * stride_kh
                        + offs_d[None, :],
                        mask=n_ok[:, None], other=0.0)  # [BLOCK_N, D]
            # the scale cast first: Inductor re-launching this kernel inside a compiled step
            # passes Python floats as fp64, which would make the logits tile fp64 math
            s = tl.dot(q, tl.trans(k)) * tl.cast(scale, tl.float32)  # [BLOCK_G, BLOCK_N]
            s = tl.where(n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(V + b * stride_vb + offs_n[:, None] * stride_vt + h * stride_vh
                        + offs_d[None, :],
                        mask=n_ok[:, None], other=0.0)  # [BLOCK_N, D]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        head = b * (KV_HEADS * G) + h * G + offs_g  # flat (b, query head) index
        part = head * num_splits + split
        tl.store(O_part + part[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None])
        tl.store(M_part + part, m, mask=g_ok)
        tl.store(L_part + part, l, mask=g_ok)


def decode_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor,
                            scale: float, start: torch.Tensor | None = None,
                            **launch) -> torch.Tensor:
    """Split-KV decode on CUDA; same contract as ``decode_attention_torch``. ``launch`` overrides
    the regime's ``LAUNCH`` entry: ``block_n`` keys per loop iteration, ``num_warps`` /
    ``num_stages`` (Triton's) and ``programs_per_sm`` (the split plan's parallelism). (With
    ``TRITON_INTERPRET=1`` it also runs on CPU fp32 tensors: that is how the CPU tests check the
    kernel.)"""
    B, _, H, D = q.shape
    room, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    regime = LAUNCH[launch_regime(B, Hkv, q.device)]
    if set(launch) - set(regime):
        raise ValueError(f"unknown split-KV launch settings {sorted(set(launch) - set(regime))}; "
                         f"known: {sorted(regime)}")
    cfg = {**regime, **launch}
    block_n = cfg["block_n"]
    if k.stride(-1) != 1 or v.stride(-1) != 1 or D & (D - 1):
        raise ValueError("decode_attention_triton needs contiguous head dims of a power-of-two "
                         "size")
    num_splits = split_plan(room, B, Hkv, block_n, q.device, cfg["programs_per_sm"])
    q2 = q.reshape(B, H, D)  # [B, 1, H, D] -> [B, H, D]
    if start is None:
        start = torch.zeros(B, dtype=torch.long, device=q.device)
    o_part = torch.empty(B * H, num_splits, D, device=q.device, dtype=torch.float32)
    m_part = torch.empty(B * H, num_splits, device=q.device, dtype=torch.float32)
    l_part = torch.empty(B * H, num_splits, device=q.device, dtype=torch.float32)
    _split_kv_kernel[(B * Hkv, num_splits)](
        q2, k, v, length, start, o_part, m_part, l_part,
        0 if length.numel() == 1 else 1, q2.stride(0), q2.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        scale, num_splits,
        KV_HEADS=Hkv, G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, BLOCK_N=block_n,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    # merge the splits: o = sum_s e^{m_s - m} acc_s / sum_s e^{m_s - m} l_s
    # (empty splits: m_s = -inf; every row has at least one valid key, so some split is not empty)
    m_max = m_part.max(dim=1, keepdim=True).values  # [B*H, 1]
    w = torch.exp(m_part - m_max)  # [B*H, S]
    o = (o_part * w[..., None]).sum(1) / (l_part * w).sum(1, keepdim=True)  # [B*H, D]
    return o.view(B, 1, H, D).to(q.dtype)  # [B*H, D] -> [B, 1, H, D]


def decode_attention(q, k, v, length, scale, start=None):
    """Triton split-KV on CUDA, the torch reference elsewhere."""
    if q.is_cuda and _HAS_TRITON:
        return decode_attention_triton(q, k, v, length, scale, start)
    return decode_attention_torch(q, k, v, length, scale, start)
