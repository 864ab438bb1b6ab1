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

The state is fp32 unless the caller keeps it narrower (bf16, or the 24-bit ``FLOAT24``), and a
batched caller can defer its writes over several tokens (``DeferredWrites``): ``lightning_state.py``
says how a state is kept.

The same kernel can also do the rest of the layer's step between its two GEMMs (``LayerEnds``):
the QK-norm and RoPE of q/k as they come out of the packed projection, and the per-head output
RMSNorm and sigmoid gate after the update. At batch 1 each of those was a kernel of its own (six
kernels per Lightning layer in a compiled step, ~13 µs and five launch gaps, against ~3 µs for the
update itself); fused, a layer's step between its GEMMs is one kernel.

* ``lightning_decode_torch``: the reference for the update (in place as well); CPU and tests. The
  reference for the fused step is the mixer's own composition (``LightningMixer.decode_in_place``).
* ``lightning_decode_triton``: the kernel (``TRITON_INTERPRET=1`` runs it on CPU fp32 tensors, which
  is how the CPU tests check it).

``kernel_applies`` decides where the kernel runs (CUDA with Triton);
``DecodeOptions(fuse_lightning=False)`` keeps the fusion off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .decode_attention import sm_count
from .lightning_state import (FLOAT24, STATE_DTYPES, DeferredWrites, deferred_step_torch,
                              state_values, stored_state)
# Launch settings per state dtype: state columns per program and warps (they change the result only
# by the order of floating-point additions). Measured on an H200 by ``bench/tune_decode_kernels.py``
# at 256 rows (one CUDA graph of back-to-back calls): fp32 0.136 ms (3.9 TB/s) vs 0.160 for the
# earlier 32 columns x 4 warps, bf16 0.079 vs 0.131 ms; wider tiles keep more loads in flight.
# ``fused_warps``, ``fused_prefetch``: the fused layer step (``LayerEnds``), one program per (row,
# head) because its output norm spans the head's V columns; prefetch loads the state before the q/k
# work. 2 fused warps: 5.4 µs vs 8.6 (4) and 8.4 (8) at 1 row, 144 µs vs 186 (4) at 256 rows, the
# plain update's 144 (H200, ``tune_decode_kernels.py --fused``).
# ``fused_split`` (with ``split_warps``, ``split_prefetch``): programs per head while rows x heads
# leave SMs idle. At batch 1, 16 programs on 132 SMs, each a chain of dependent loads, took 11.4 µs
# in the 512K step where the plain update's 32 programs took 3.7. Off (1): split over 4 programs on
# an H100 the kernel took 5.5 µs against 6.3, but the 512K step 7.30 ms against 7.05
# (``profile_decode.py``).
# The narrower states take 4 fused warps: at 2, a thread's share of the tile and the work of
# narrowing it overflow its 255 registers (ptxas, sm_90: the 24-bit state spills ~1.5 KB a thread,
# bf16 written every 4 tokens 32 B; tests/test_kernel_compile.py). H100, 512 rows, µs per layer:
# 24 bits written every token 591 (2 warps) -> 369 (4), every 4 tokens 310 -> 338; fp32 370 and
# 258 (``profile_decode.py``). bf16 on 4 warps: not yet timed.
LAUNCH = {dtype: dict(block_v=block_v, num_warps=8, fused_warps=warps, fused_prefetch=False,
                      fused_split=1, split_warps=2, split_prefetch=True)
          for dtype, block_v, warps in ((torch.float32, 64, 2), (torch.bfloat16, 128, 4),
                                        (FLOAT24, 64, 4))}

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    _HAS_TRITON = False


def lightning_decode_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           log_decay: torch.Tensor, scale: float, state: torch.Tensor,
                           deferred: DeferredWrites | None = None) -> torch.Tensor:
    """q/k ``[B, 1, H, K]``, v ``[B, 1, H, V]``, log_decay ``[H]``, state ``[B, H, K, V]`` (or a
    24-bit state's bytes ``[B, H, K, 3V]``; updated in place) -> o ``[B, 1, H, V]`` in q's dtype.
    The update and the output are computed in fp32 at least (the state's dtype when wider); a bf16
    or 24-bit state is rounded once, when it is written back. ``deferred``: the state is written
    only at each row's ``every``-th token, the tokens between held there."""
    s = state_values(state)  # the state itself when it is already fp32/fp64
    acc = s.dtype
    qf, kf, vf = q[:, 0].to(acc), k[:, 0].to(acc), v[:, 0].to(acc)  # [B, H, K] / [B, H, V]
    if deferred is not None:
        group = qf.shape[1] // kf.shape[1]  # GQA: k/v head h // group serves query head h
        kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
        o, s = deferred_step_torch(s, qf, kf, vf, log_decay, deferred)
        state.copy_(stored_state(s, state.dtype))
        return (o * scale)[:, None].to(q.dtype)  # [B, H, V] -> [B, 1, H, V]
    decay = log_decay.to(device=state.device, dtype=acc).exp()[None, :, None, None]  # [1, H, 1, 1]
    s.mul_(decay).add_(kf[..., :, None] * vf[..., None, :])  # [B, H, K, V]
    o = torch.einsum("bhk,bhkv->bhv", qf, s) * scale  # [B, H, V]
    if s is not state:
        state.copy_(stored_state(s, state.dtype))
    return o[:, None].to(q.dtype)  # [B, H, V] -> [B, 1, H, V]


if _HAS_TRITON:
    from .lightning_state import deferred_rows, held_output, hold_token, load_rows, state_tiles, \
        store_rows

    @triton.jit
    def _rope_cos_sin(Pos, InvFreq, lo, ROPE: tl.constexpr):
        """cos/sin ``[D/2]`` of this row's position times each inverse frequency (ones/zeros
        without RoPE). The angle is the fp32 product, as torch forms it; it is reduced to [-π, π]
        in fp64 before the fp32 cos/sin (at position 2^19 it is ~5e5 rad, far outside the range
        where a GPU's fast cos/sin are accurate)."""
        if ROPE:
            angle = tl.load(Pos).to(tl.float32) * tl.load(InvFreq + lo).to(tl.float32)
            a = angle.to(tl.float64)
            # fp64 tensors: a bare Python float would enter as fp32 (2π off by 1.7e-7, which times
            # ~8e4 turns is 0.01 rad); a multiply, not a division (fp64 division is slow)
            two_pi = tl.full(lo.shape, 6.283185307179586, tl.float64)
            turns = tl.floor(a * tl.full(lo.shape, 0.15915494309189535, tl.float64) + 0.5)
            r = (a - two_pi * turns).to(tl.float32)
            return tl.cos(r), tl.sin(r)
        return tl.full(lo.shape, 1.0, tl.float32), tl.zeros(lo.shape, tl.float32)

    @triton.jit
    def _qk_half_pair(X, W, c, s, lo, hi, eps, D: tl.constexpr, NORM: tl.constexpr,
                      ROPE: tl.constexpr):
        """One head's q or k ``[D]`` as two fp32 halves ``[D/2]``: RMS-normalised times W (NORM),
        then rotated by cos/sin ``c``/``s`` (ROPE; rotate-half, whose tables repeat after D/2)."""
        x1 = tl.load(X + lo).to(tl.float32)
        x2 = tl.load(X + hi).to(tl.float32)
        if NORM:
            # (a float scalar arrives as fp64 from Inductor: kept out of the fp32 math here and
            # below, or the state's update turns fp64)
            r = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + tl.cast(eps, tl.float32))
            x1 = x1 * r * tl.load(W + lo).to(tl.float32)
            x2 = x2 * r * tl.load(W + hi).to(tl.float32)
        if ROPE:
            x1, x2 = x1 * c - x2 * s, x2 * c + x1 * s
        return x1, x2

    @triton.jit
    def _state_rows(tile, tile_lo, s, k, v, q, decay, v_ok, STATE24: tl.constexpr):
        """Rows of one state tile ``[D/2, BLOCK_V]``, loaded as ``s`` (fp32): S <- decay S + kᵀv,
        written back in place; returns their share of q S ``[BLOCK_V]`` (from the fp32 update,
        before any rounding of the store)."""
        s = decay * s + k[:, None] * v[None, :]
        store_rows(tile, tile_lo, s, v_ok, STATE24)
        return tl.sum(q[:, None] * s, axis=0)

    @triton.jit
    def _finish_head(o, offs_v, v_ok, b, h, OW, G, O, stride_gb, stride_ob, eps_o, gate_scale,
                     DV: tl.constexpr, OUT_NORM: tl.constexpr, GATE: tl.constexpr):
        """The output's columns ``offs_v`` of head h (all of them when OUT_NORM): the per-head
        RMSNorm times its weight, the gate, the store."""
        if OUT_NORM:  # RMSNorm over the head's DV outputs, times its weight
            o = o * tl.rsqrt(tl.sum(o * o, 0) / DV + tl.cast(eps_o, tl.float32))
            o = o * tl.load(OW + h * DV + offs_v, mask=v_ok, other=0.0).to(tl.float32)
        if GATE:  # gate_scale * sigmoid(x W_z)
            z = tl.load(G + b * stride_gb + h * DV + offs_v, mask=v_ok, other=0.0).to(tl.float32)
            o = o * tl.cast(gate_scale, tl.float32) * tl.sigmoid(z)
        tl.store(O + b * stride_ob + h * DV + offs_v, o.to(O.dtype.element_ty), mask=v_ok)

    @triton.jit
    def _finish_split_head(o, offs_v, v_ok, b, h, Part, Arrived, OW, G, O, stride_gb, stride_ob,
                           eps_o, gate_scale, H: tl.constexpr, DV: tl.constexpr,
                           BLOCK_DV: tl.constexpr, V_SPLIT: tl.constexpr, OUT_NORM: tl.constexpr,
                           GATE: tl.constexpr):
        """The output norm spans the head's V_SPLIT programs: each parks its columns ``o`` in
        ``Part``, and the last to arrive finishes the whole head. The barrier orders every
        thread's stores before the release; the last program resets the arrival count for the
        next call."""
        slot = b * H + h
        tl.store(Part + slot * DV + offs_v, o, mask=v_ok)
        tl.debug_barrier()
        if tl.atomic_add(Arrived + slot, 1, sem="acq_rel") == V_SPLIT - 1:
            tl.debug_barrier()
            all_v = tl.arange(0, BLOCK_DV)
            all_ok = all_v < DV
            # [BLOCK_DV], read past L1: other SMs wrote it
            head = tl.load(Part + slot * DV + all_v, mask=all_ok, other=0.0, cache_modifier=".cg")
            _finish_head(head, all_v, all_ok, b, h, OW, G, O, stride_gb, stride_ob, eps_o,
                         gate_scale, DV, OUT_NORM, GATE)
            tl.store(Arrived + slot, 0)

    @triton.jit
    def _written_step(t1, l1, t2, l2, s1, s2, q1, q2, k1, k2, v, g, v_ok, PREFETCH: tl.constexpr,
                      STATE24: tl.constexpr):
        """Each token written back: both halves of the tile (``s1``/``s2`` loaded already with
        PREFETCH, else here one after the other) -> q S ``[BLOCK_V]``."""
        decay = tl.exp(g)
        if not PREFETCH:
            s1 = load_rows(t1, l1, v_ok, STATE24)
        o = _state_rows(t1, l1, s1, k1, v, q1, decay, v_ok, STATE24)
        if not PREFETCH:
            s2 = load_rows(t2, l2, v_ok, STATE24)
        return o + _state_rows(t2, l2, s2, k2, v, q2, decay, v_ok, STATE24)

    @triton.jit
    def _deferred_step(t1, l1, t2, l2, q1, q2, k1, k2, v, g, j, PK, PV, lo, hi, offs_v, v_ok,
                       first, DK: tl.constexpr, DV: tl.constexpr, EVERY: tl.constexpr,
                       STATE24: tl.constexpr):
        """Writes deferred (``lightning_state.DeferredWrites``): this token is the row's held slot
        j; its state is written only at j = EVERY-1 -> q S_t ``[BLOCK_V]``. No program reads the
        slot it writes, and the head's programs read only slots below j."""
        j = tl.where(j < 0, j + EVERY, j)  # Triton's % keeps the dividend's sign; torch's does not
        o = (tl.sum(q1 * k1, 0) + tl.sum(q2 * k2, 0)) * v
        o += held_output(q1, q2, PK, PV, lo, hi, offs_v, v_ok, j, g, DK, DV, EVERY)
        o += deferred_rows(t1, l1, q1, k1, v, PK, PV, lo, offs_v, v_ok, j, g, DK, DV, EVERY,
                           STATE24)
        o += deferred_rows(t2, l2, q2, k2, v, PK, PV, hi, offs_v, v_ok, j, g, DK, DV, EVERY,
                           STATE24)
        hold_token(k1, k2, v, PK, PV, lo, hi, offs_v, v_ok, j, first, DK, DV, EVERY)
        return o

    @triton.jit
    def _lightning_decode_kernel(
        Q, K, V, G, Pos, InvFreq, QW, KW, OW, LogDecay, S, O, Part, Arrived, Cur, Base, PK, PV,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb, stride_pb,
        stride_sb, stride_sh, stride_ob,
        scale, eps_qk, eps_o, gate_scale,
        H: tl.constexpr, KV_GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        BLOCK_V: tl.constexpr, QK_NORM: tl.constexpr, ROPE: tl.constexpr,
        OUT_NORM: tl.constexpr, GATE: tl.constexpr, PREFETCH: tl.constexpr,
        V_SPLIT: tl.constexpr, BLOCK_DV: tl.constexpr, SK: tl.constexpr, LK: tl.constexpr,
        STATE24: tl.constexpr, EVERY: tl.constexpr,
    ):
        """One program: row b, head h, value columns [pid_v * BLOCK_V, +BLOCK_V) of the state. Head
        h reads k/v head h // KV_GROUP. With OUT_NORM the norm spans the head: one program holds
        all its columns (V_SPLIT 1) or V_SPLIT programs share them through ``Part`` (fp32
        ``[B*H*DV]``) and ``Arrived`` (int32 ``[B*H]``, zero between calls). PREFETCH: load the
        state before preparing q/k, so the two overlap (both halves at once with 4 warps spilled
        registers). State rows are SK elements apart (a 24-bit state's third bytes LK). EVERY > 1:
        writes deferred, slots ``PK``/``PV``, positions ``Cur``/``Base`` (``DeferredWrites``)."""
        pid_bh = tl.program_id(0)
        pid_v = tl.program_id(1)
        # rows x heads x K x V passes 2^31 elements at a few hundred rows
        b = (pid_bh // H).to(tl.int64)
        h = pid_bh % H
        hk = h // KV_GROUP
        lo = tl.arange(0, DK // 2)
        hi = lo + DK // 2
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        v_ok = offs_v < DV
        # the state's rows [0, DK/2) and [DK/2, DK), each [DK/2, BLOCK_V]
        tile, tile_lo = state_tiles(S + b * stride_sb + h * stride_sh, offs_v, DV, STATE24)
        t1, l1 = tile + lo[:, None] * SK, tile_lo[None, :] + lo[:, None] * LK
        t2, l2 = tile + hi[:, None] * SK, tile_lo[None, :] + hi[:, None] * LK
        if PREFETCH:
            s1, s2 = load_rows(t1, l1, v_ok, STATE24), load_rows(t2, l2, v_ok, STATE24)
        else:  # (stand-ins: _written_step loads them)
            s1, s2 = v_ok, v_ok
        c, s = _rope_cos_sin(Pos + b * stride_pb, InvFreq, lo, ROPE)
        q1, q2 = _qk_half_pair(Q + b * stride_qb + h * stride_qh, QW, c, s, lo, hi, eps_qk, DK,
                               QK_NORM, ROPE)
        k1, k2 = _qk_half_pair(K + b * stride_kb + hk * stride_kh, KW, c, s, lo, hi, eps_qk, DK,
                               QK_NORM, ROPE)
        v = tl.load(V + b * stride_vb + hk * stride_vh + offs_v, mask=v_ok, other=0.0)
        v = v.to(tl.float32)  # [BLOCK_V]
        g = tl.load(LogDecay + h).to(tl.float32)
        if EVERY == 1:
            o = _written_step(t1, l1, t2, l2, s1, s2, q1, q2, k1, k2, v, g, v_ok, PREFETCH, STATE24)
        else:
            j = (tl.load(Cur + b) - tl.load(Base + b)) % EVERY  # the token's held slot
            slot = (b * H + h) * (EVERY - 1)
            o = _deferred_step(t1, l1, t2, l2, q1, q2, k1, k2, v, g, j, PK + slot * DK,
                               PV + slot * DV, lo, hi, offs_v, v_ok, pid_v == 0, DK, DV, EVERY,
                               STATE24)
        o = o * tl.cast(scale, tl.float32)  # [BLOCK_V] (Inductor passes an fp64 scale)
        if V_SPLIT == 1:  # this program holds the whole head
            _finish_head(o, offs_v, v_ok, b, h, OW, G, O, stride_gb, stride_ob, eps_o, gate_scale,
                         DV, OUT_NORM, GATE)
        else:
            _finish_split_head(o, offs_v, v_ok, b, h, Part, Arrived, OW, G, O, stride_gb,
                               stride_ob, eps_o, gate_scale, H, DV, BLOCK_DV, V_SPLIT, OUT_NORM,
                               GATE)


@dataclass(frozen=True)
class LayerEnds:
    """What the fused decode step applies around one Lightning layer's state update (None leaves
    a part out): before it, the QK-norm (weights ``[K]``) and RoPE (``rope``: each row's position
    ``[B, 1]`` int64 and the inverse frequencies ``[K/2]`` fp32, HF's rotate-half convention);
    after it, the per-head output RMSNorm (weight ``[H*V]``) and the output gate
    ``gate_scale * sigmoid(gate)`` (``gate``: its logits ``[B, 1, H*V]``). ``scratch``
    (``split_scratch``) lets ``fused_split`` programs share a head while the rows x heads are fewer
    than the GPU's SMs."""

    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_eps: float = 1e-6
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    o_norm: torch.Tensor | None = None
    o_eps: float = 1e-6
    gate: torch.Tensor | None = None
    gate_scale: float = 1.0
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None


def split_scratch(rows: int, heads: int, dv: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """What the fused step needs to split a head's columns over programs (``LayerEnds.scratch``):
    each program's output columns, fp32 ``[rows*heads*dv]``, and how many of a head's programs
    have finished, int32 ``[rows*heads]``. The kernel leaves the counts at zero, so one scratch
    serves every layer and step of a decoder (its kernels run one after another)."""
    return (torch.empty(rows * heads * dv, device=device, dtype=torch.float32),
            torch.zeros(rows * heads, device=device, dtype=torch.int32))

def _check_inputs(q, k, v, state, ends: LayerEnds | None) -> None:
    B, _, H, DK = q.shape
    Hkv, DV = v.shape[2], v.shape[-1]
    width = 3 * DV if state.dtype == FLOAT24 else DV  # a 24-bit state's row: 3 bytes per column
    if (state.dtype not in STATE_DTYPES or not state.is_contiguous()
            or tuple(state.shape) != (B, H, DK, width)):
        raise ValueError(f"the state must be a contiguous fp32 or bf16 [{B}, {H}, {DK}, {DV}] "
                         f"tensor or a 24-bit state's bytes [{B}, {H}, {DK}, {3 * DV}], got "
                         f"{state.dtype} {tuple(state.shape)}")
    if state.dtype == FLOAT24 and (DV % 2 or state.data_ptr() % 2):
        raise ValueError(f"a 24-bit state needs an even value dim and an even start address (its "
                         f"top two bytes are read as int16 pairs), got {DV}")
    if DK & (DK - 1) or DK < 2 or any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("lightning_decode_triton needs unit-stride head dims and a power-of-two "
                         "key dim")
    if k.shape[2] != Hkv or H % Hkv:
        raise ValueError(f"k/v must have the same number of heads, dividing q's {H}; got "
                         f"{k.shape[2]} and {Hkv}")
    if ends is None:
        return
    if (ends.q_norm is None) != (ends.k_norm is None):
        raise ValueError("LayerEnds: give both QK-norm weights or neither")
    if ends.gate is not None and (ends.gate.stride(-1) != 1 or ends.gate.shape[0] != B):
        raise ValueError(f"LayerEnds: the gate's logits must be [{B}, 1, H*V] with a unit-stride "
                         f"last dim, got {tuple(ends.gate.shape)}")
    if ends.rope is not None:
        pos, inv_freq = ends.rope
        if pos.shape[0] != B or pos.dtype != torch.long or inv_freq.shape != (DK // 2,):
            raise ValueError(f"LayerEnds: rope needs int64 positions [{B}, 1] and {DK // 2} "
                             f"inverse frequencies, got {pos.dtype} {tuple(pos.shape)} and "
                             f"{tuple(inv_freq.shape)}")


def _fused_split(programs: int, dv: int, e: LayerEnds, cfg: dict, device) -> int:
    """Programs per head of the fused step: ``fused_split`` while one per (row, head) leaves SMs
    idle and the caller gave a scratch, else 1."""
    split = cfg["fused_split"]
    if split == 1 or e.scratch is None or programs >= sm_count(device):
        return 1
    part, arrived = e.scratch
    if split & (split - 1) or split > dv or part.numel() < programs * dv \
            or arrived.numel() < programs:
        raise ValueError(f"fused_split={split} needs a power of two up to the head's {dv} "
                         f"columns and a scratch for {programs} heads (split_scratch)")
    return split


def _check_deferred(d: DeferredWrites, B: int, H: int, DK: int, DV: int) -> None:
    n = d.keys.shape[2] if d.keys.dim() == 4 else 0
    want = {"keys": ((B, H, n, DK), torch.float32), "values": ((B, H, n, DV), torch.float32),
            "pos": ((B,), torch.long), "base": ((B,), torch.long)}
    for name, (shape, dtype) in want.items():
        t = getattr(d, name)
        if n < 1 or tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"DeferredWrites.{name} must be a contiguous {dtype} {shape} tensor "
                             f"(deferred_writes makes them), got {t.dtype} {tuple(t.shape)}")


def _launch_shape(cfg: dict, e: LayerEnds, B: int, H: int, DV: int, device,
                  deferred: bool) -> tuple[int, int, bool, int]:
    """(columns per program, warps, prefetch, programs per head when a head is split)."""
    if e.o_norm is None:  # the plain update: tiles of block_v columns
        return cfg["block_v"], cfg["num_warps"], False, 1
    split = _fused_split(B * H, DV, e, cfg, device)
    prefix = "split" if split > 1 else "fused"
    # deferred writes read the state's halves one after the other (no prefetch)
    prefetch = cfg[f"{prefix}_prefetch"] and not deferred
    return triton.next_power_of_2(DV) // split, cfg[f"{prefix}_warps"], prefetch, split


def lightning_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            log_decay: torch.Tensor, scale: float, state: torch.Tensor,
                            ends: LayerEnds | None = None, deferred: DeferredWrites | None = None,
                            **launch) -> torch.Tensor:
    """Same contract as ``lightning_decode_torch``; ``state`` must be a contiguous fp32 or bf16
    ``[B, H, K, V]`` or a 24-bit state's bytes ``[B, H, K, 3V]`` (bf16: half the bytes per step,
    24 bits: 3/4; the arithmetic stays fp32; V even for 24 bits); k/v may have fewer
    heads than q (GQA: head h reads k/v head h // (H / Hkv)). ``ends`` adds the layer's QK-norm and
    RoPE before the update and its output norm and gate after it, in the same kernel (then a program
    spans a head's V columns, or ``fused_split`` programs share it: ``_fused_split``). ``deferred``:
    the state written every few tokens (``lightning_state``). ``launch`` (keys of ``LAUNCH``)
    overrides the state dtype's ``LAUNCH`` entry."""
    _check_inputs(q, k, v, state, ends)
    if set(launch) - set(LAUNCH[state.dtype]):
        raise ValueError(f"unknown Lightning decode launch settings "
                         f"{sorted(set(launch) - set(LAUNCH[state.dtype]))}; "
                         f"known: {sorted(LAUNCH[state.dtype])}")
    B, _, H, DK = q.shape
    Hkv, DV = v.shape[2], v.shape[-1]
    if deferred is not None:
        _check_deferred(deferred, B, H, DK, DV)
    e = ends or LayerEnds()
    block_v, warps, prefetch, split = _launch_shape({**LAUNCH[state.dtype], **launch}, e, B, H,
                                                    DV, q.device, deferred is not None)
    o = torch.empty(B, 1, H, DV, device=q.device, dtype=q.dtype)
    log_decay = log_decay.to(device=q.device, dtype=torch.float32).contiguous()
    pos, inv_freq = e.rope or (q, q)  # (q: any pointer where a part is left out)
    gate = q if e.gate is None else e.gate
    programs = triton.cdiv(DV, block_v)  # per head (fewer than split when DV is not a power of 2)
    # unused parts: a tensor the kernel only reads stands in (never the output, which a compiler
    # that cannot see the constexpr branch would take for one more written argument)
    part, arrived = e.scratch if split > 1 else (log_decay, log_decay)
    held = ((deferred.pos, deferred.base, deferred.keys, deferred.values) if deferred is not None
            else (log_decay,) * 4)
    state24 = state.dtype == FLOAT24
    _lightning_decode_kernel[(B * H, programs)](
        q, k, v, gate, pos, inv_freq, q if e.q_norm is None else e.q_norm,
        q if e.k_norm is None else e.k_norm, q if e.o_norm is None else e.o_norm,
        log_decay, state, o, part, arrived, *held,
        q.stride(0), q.stride(2), k.stride(0), k.stride(2), v.stride(0), v.stride(2),
        gate.stride(0), pos.stride(0),
        state.stride(0), state.stride(1), o.stride(0),
        scale, e.qk_eps, e.o_eps, e.gate_scale,
        H=H, KV_GROUP=H // Hkv, DK=DK, DV=DV, BLOCK_V=block_v, QK_NORM=e.q_norm is not None,
        ROPE=e.rope is not None, OUT_NORM=e.o_norm is not None, GATE=e.gate is not None,
        PREFETCH=prefetch, V_SPLIT=programs if split > 1 else 1,
        BLOCK_DV=triton.next_power_of_2(DV), SK=3 * DV // 2 if state24 else DV, LK=3 * DV,
        STATE24=state24, EVERY=deferred.every if deferred is not None else 1, num_warps=warps,
    )
    return o


def kernel_applies(x: torch.Tensor) -> bool:
    """Whether decoding on ``x``'s device runs the kernel: CUDA with Triton."""
    return x.is_cuda and _HAS_TRITON


def lightning_decode_(q, k, v, log_decay, scale, state, deferred: DeferredWrites | None = None):
    """The kernel on CUDA, the reference elsewhere."""
    if kernel_applies(q):
        return lightning_decode_triton(q, k, v, log_decay, scale, state, deferred=deferred)
    return lightning_decode_torch(q, k, v, log_decay, scale, state, deferred)
