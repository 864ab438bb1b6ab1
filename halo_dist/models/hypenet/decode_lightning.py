"""One Lightning-attention decode step that updates the state in place: the RNN half of the
static (CUDA-graph) decode step (``static_decode.py``).

Per row b and head h, with the head's log-decay g_h:
    S <- exp(g_h) S + kᵀ v ,   o = scale · q S
fla's ``fused_recurrent_simple_gla`` computes the same but writes the new state to a fresh tensor,
which the static cache then copies back into its fixed buffer: the state is read once and written
twice. At batch 1 that is noise (1 MB per layer); for batched rollouts it dominates the step (256
rows x 16 heads x 128 x 128 fp32 = 268 MB per layer, 21 layers). Here each program owns one
``[K, BLOCK_V]`` tile of one (row, head) state: it reads the tile, updates it in registers and
writes it back where it was, so the state moves once each way and no copy follows.

The state is fp32 unless the caller keeps it in bf16 (``StaticDecoder(state_dtype=...)``): then it
is read and written in bf16 and updated in fp32 registers, half the bytes of a batched step, at the
price of one bf16 rounding of the state per token.

* ``lightning_decode_torch``: the reference (in place as well); CPU and tests.
* ``lightning_decode_triton``: the kernel (``TRITON_INTERPRET=1`` runs it on CPU fp32 tensors, which
  is how the CPU tests check it).

``lightning_decode_`` dispatches (``HALO_DECODE_LIGHTNING=torch`` forces the reference on CUDA).
"""

from __future__ import annotations

import os

import torch

# dtypes the in-place kernel keeps a state in (fp32 by default; bf16 halves a batched step's bytes)
STATE_DTYPES = (torch.float32, torch.bfloat16)
# Launch settings per state dtype: state columns per program and warps (they change the result only
# by the order of floating-point additions). Measured on an H200 by ``bench/tune_decode_kernels.py``
# at 256 rows (one CUDA graph of back-to-back calls): fp32 0.136 ms (3.9 TB/s) vs 0.160 for the
# earlier 32 columns x 4 warps, bf16 0.079 vs 0.131 ms; wider tiles keep more loads in flight.
LAUNCH = {torch.float32: dict(block_v=64, num_warps=8),
          torch.bfloat16: dict(block_v=128, num_warps=8)}

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    _HAS_TRITON = False


def lightning_decode_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           log_decay: torch.Tensor, scale: float,
                           state: torch.Tensor) -> torch.Tensor:
    """q/k ``[B, 1, H, K]``, v ``[B, 1, H, V]``, log_decay ``[H]``, state ``[B, H, K, V]`` (updated
    in place) -> o ``[B, 1, H, V]`` in q's dtype. The update and the output are computed in fp32 at
    least (the state's dtype when wider); a bf16 state is rounded once, when it is written back."""
    acc = torch.promote_types(state.dtype, torch.float32)
    s = state.to(acc)  # the state itself when it is already fp32/fp64
    qf, kf, vf = q[:, 0].to(acc), k[:, 0].to(acc), v[:, 0].to(acc)  # [B, H, K] / [B, H, V]
    decay = log_decay.to(device=state.device, dtype=acc).exp()[None, :, None, None]  # [1, H, 1, 1]
    s.mul_(decay).add_(kf[..., :, None] * vf[..., None, :])  # [B, H, K, V]
    o = torch.einsum("bhk,bhkv->bhv", qf, s) * scale  # [B, H, V]
    if s is not state:
        state.copy_(s)
    return o[:, None].to(q.dtype)  # [B, H, V] -> [B, 1, H, V]


if _HAS_TRITON:

    @triton.jit
    def _lightning_decode_kernel(
        Q, K, V, LogDecay, S, O,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
        stride_sb, stride_sh, stride_ob, stride_oh,
        scale,
        H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        """One program: row b, head h, value columns [pid_v * BLOCK_V, +BLOCK_V) of the state."""
        pid_bh = tl.program_id(0)
        pid_v = tl.program_id(1)
        # rows x heads x K x V passes 2^31 elements at a few hundred rows
        b = (pid_bh // H).to(tl.int64)
        h = pid_bh % H
        offs_k = tl.arange(0, DK)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        v_ok = offs_v < DV
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_k).to(tl.float32)  # [DK]
        k = tl.load(K + b * stride_kb + h * stride_kh + offs_k).to(tl.float32)  # [DK]
        # [BLOCK_V]
        v = tl.load(V + b * stride_vb + h * stride_vh + offs_v, mask=v_ok, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(LogDecay + h).to(tl.float32))
        # [DK, BLOCK_V]
        tile = S + b * stride_sb + h * stride_sh + offs_k[:, None] * DV + offs_v[None, :]
        s = tl.load(tile, mask=v_ok[None, :], other=0.0).to(tl.float32)
        s = decay * s + k[:, None] * v[None, :]
        tl.store(tile, s.to(S.dtype.element_ty, fp_downcast_rounding="rtne"), mask=v_ok[None, :])
        o = tl.sum(q[:, None] * s, axis=0) * scale  # [BLOCK_V]
        tl.store(O + b * stride_ob + h * stride_oh + offs_v, o.to(O.dtype.element_ty), mask=v_ok)


def lightning_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            log_decay: torch.Tensor, scale: float, state: torch.Tensor,
                            **launch) -> torch.Tensor:
    """Same contract as ``lightning_decode_torch``; ``state`` must be a contiguous fp32 or bf16
    ``[B, H, K, V]`` (bf16: half the bytes per step; the arithmetic stays fp32). ``launch``
    (``block_v``, ``num_warps``) overrides the state dtype's ``LAUNCH`` entry."""
    B, _, H, DK = q.shape
    DV = v.shape[-1]
    if (state.dtype not in STATE_DTYPES or not state.is_contiguous()
            or tuple(state.shape) != (B, H, DK, DV)):
        raise ValueError(f"the state must be a contiguous fp32 or bf16 [{B}, {H}, {DK}, {DV}] "
                         f"tensor, got {state.dtype} {tuple(state.shape)}")
    if DK & (DK - 1) or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("lightning_decode_triton needs unit-stride head dims and a power-of-two "
                         "key dim")
    if set(launch) - set(LAUNCH[state.dtype]):
        raise ValueError(f"unknown Lightning decode launch settings "
                         f"{sorted(set(launch) - set(LAUNCH[state.dtype]))}; "
                         f"known: {sorted(LAUNCH[state.dtype])}")
    cfg = {**LAUNCH[state.dtype], **launch}
    block_v = cfg["block_v"]
    o = torch.empty(B, 1, H, DV, device=q.device, dtype=q.dtype)
    log_decay = log_decay.to(device=q.device, dtype=torch.float32).contiguous()
    _lightning_decode_kernel[(B * H, triton.cdiv(DV, block_v))](
        q, k, v, log_decay, state, o,
        q.stride(0), q.stride(2), k.stride(0), k.stride(2), v.stride(0), v.stride(2),
        state.stride(0), state.stride(1), o.stride(0), o.stride(2),
        scale, H=H, DK=DK, DV=DV, BLOCK_V=block_v, num_warps=cfg["num_warps"],
    )
    return o


def lightning_decode_(q, k, v, log_decay, scale, state):
    """The kernel on CUDA, the reference elsewhere (or with ``HALO_DECODE_LIGHTNING=torch``)."""
    if q.is_cuda and _HAS_TRITON and os.environ.get("HALO_DECODE_LIGHTNING", "triton") != "torch":
        return lightning_decode_triton(q, k, v, log_decay, scale, state)
    return lightning_decode_torch(q, k, v, log_decay, scale, state)
