"""How a Lightning layer's decode state is kept between tokens (``decode_lightning.py`` updates it):
its storage dtype, and writes deferred over several tokens.

Storage. The state ``[B, H, K, V]`` is fp32 unless the caller keeps it in bf16
(``DecodeOptions(state_dtype=torch.bfloat16)``); either way the kernel updates it in fp32 registers
and rounds once when it writes it back. bf16 halves the bytes, but the rounding compounds (1 − λ of
the slowest heads is bf16's own spacing) and moves the sampling distribution far
(bench/rollout_state_drift.py).

Deferred writes (``DeferredWrites``). A batched rollout step reads every row's state and writes it
back, so the state moves twice per token. The update is linear with a per-head constant decay λ, so
after n tokens past a written state S₀

    S_n = λⁿ S₀ + Σ_{i<n} λ^{n-1-i} k_iᵀ v_i ,   q S_n = λⁿ (q S₀) + Σ_{i<n} λ^{n-1-i} (q·k_i) v_i :

a row can keep its last few tokens' k and v (a few KB) beside the written state and write the state
back only every ``every`` tokens, folding them in. The state then moves 1 + 1/every times per token
instead of twice (every = 4: 37.5% fewer state bytes), and the step's output is the same sum, in a
different order of fp32 additions. Each row counts its held tokens from the cache's positions:
``(pos - base) % every``, where ``base`` is the position at which the row's state was last written
whole (its prefill or refill), so the kernels need no counter of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# dtypes the in-place kernel keeps a state in (fp32 by default; bf16 halves a batched step's bytes)
STATE_DTYPES = (torch.float32, torch.bfloat16)

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    _HAS_TRITON = False


def stored_state(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A state ``[B, H, K, V]`` as the in-place kernel keeps it in ``dtype`` (contiguous)."""
    return x.to(dtype).contiguous()


def state_values(state: torch.Tensor) -> torch.Tensor:
    """A kept state as numbers ``[B, H, K, V]``, fp32 at least (the inverse of ``stored_state``,
    up to its rounding)."""
    return state.to(torch.promote_types(state.dtype, torch.float32))


@dataclass(frozen=True)
class DeferredWrites:
    """One Lightning layer's tokens not yet in its written state (see the module docstring):
    ``keys`` ``[B, H, every-1, K]`` and ``values`` ``[B, H, every-1, V]`` fp32 (per query head,
    after the QK-norm and RoPE), slot i the i-th token since ``base``; ``pos`` ``[B]`` int64, each
    row's next position (the cache's, advanced by the step); ``base`` ``[B]`` int64, the position
    at which the row's state was last written whole (set with the state, never by the step)."""

    keys: torch.Tensor
    values: torch.Tensor
    pos: torch.Tensor
    base: torch.Tensor

    @property
    def every(self) -> int:
        return self.keys.shape[2] + 1

    def held(self) -> torch.Tensor:
        """``[B]`` tokens each row holds beside its written state (the next token's slot)."""
        return (self.pos - self.base) % self.every


def deferred_writes(rows: int, heads: int, dk: int, dv: int, every: int, pos: torch.Tensor,
                    base: torch.Tensor, dtype: torch.dtype = torch.float32) -> DeferredWrites:
    """Zeroed slots for ``every - 1`` tokens per (row, head) (zeros: a slot a row does not hold is
    masked, never read as stale NaN); fp32 (the kernel's), fp64 for the torch reference's exactness
    tests."""
    if every < 2:
        raise ValueError(f"deferred writes need every >= 2 tokens, got {every}")
    kw = dict(device=pos.device, dtype=dtype)
    return DeferredWrites(torch.zeros(rows, heads, every - 1, dk, **kw),
                          torch.zeros(rows, heads, every - 1, dv, **kw), pos, base)


def _decays(g: torch.Tensor, powers: torch.Tensor) -> torch.Tensor:
    """λ^p = exp(g p), elementwise (broadcast by the callers' views)."""
    return torch.exp(g * powers.to(g.dtype))


def deferred_values(s: torch.Tensor, d: DeferredWrites, log_decay: torch.Tensor) -> torch.Tensor:
    """The state the rows would have with every held token written: ``s`` the written state's
    values ``[B, H, K, V]`` (fp32 or wider) -> ``λⁿ s + Σ_{i<n} λ^{n-1-i} k_iᵀ v_i`` with n =
    ``held()``."""
    g = log_decay.to(device=s.device, dtype=s.dtype)  # [H]
    n = d.held()  # [B]
    i = torch.arange(d.every - 1, device=s.device)
    power = (n[:, None] - 1 - i[None, :]).clamp(min=0)  # [B, every-1]
    # [1, H, 1] x [B, 1, every-1] -> [B, H, every-1]; zero for slots the row does not hold
    w = torch.where((i[None, :] < n[:, None])[:, None, :],
                    _decays(g[None, :, None], power[:, None, :]), 0.0)
    lam_n = _decays(g[None, :], n[:, None])[..., None, None]  # [B, H, 1, 1]
    keys, values = d.keys.to(s.dtype), d.values.to(s.dtype)
    return lam_n * s + torch.einsum("bhi,bhik,bhiv->bhkv", w, keys, values)


def deferred_step_torch(s: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        log_decay: torch.Tensor, d: DeferredWrites) -> tuple[torch.Tensor,
                                                                             torch.Tensor]:
    """One token with deferred writes, in ``s``'s dtype (fp32 or wider): ``s`` the written state
    ``[B, H, K, V]``, q/k ``[B, H, K]``, v ``[B, H, V]`` -> (q S_t ``[B, H, V]`` unscaled, the
    written state after the token ``[B, H, K, V]``: rows at their last held slot fold every held
    token and this one in, the others keep ``s`` and hold k/v in ``d``'s slot). Sync-free."""
    g = log_decay.to(device=s.device, dtype=s.dtype)  # [H]
    keys, values = d.keys.to(s.dtype), d.values.to(s.dtype)  # [B, H, every-1, K or V]
    j = d.held()  # [B] the token's slot
    i = torch.arange(d.every - 1, device=s.device)
    o = _decays(g[None, :], j[:, None] + 1)[..., None] * torch.einsum("bhk,bhkv->bhv", q, s)
    o = o + (q * k).sum(-1, keepdim=True) * v  # [B, H, V]
    held = (i[None, :] < j[:, None])[:, None, :]  # [B, 1, every-1]
    w = torch.where(held, _decays(g[None, :, None], j[:, None, None] - i[None, None, :]), 0.0)
    o = o + torch.einsum("bhi,bhik,bhk,bhiv->bhv", w, keys, q, values)
    folded = (torch.exp(g * d.every)[None, :, None, None] * s
              + torch.einsum("hi,bhik,bhiv->bhkv", _decays(g[:, None], d.every - 1 - i[None, :]),
                             keys, values)
              + k[..., :, None] * v[..., None, :])  # [B, H, K, V]
    last = (j == d.every - 1)[:, None, None, None]  # [B, 1, 1, 1]
    slot = (i[None, :] == j[:, None])[:, None, :, None]  # [B, 1, every-1, 1]: none when last
    d.keys.copy_(torch.where(slot, k[:, :, None, :].to(d.keys.dtype), d.keys))
    d.values.copy_(torch.where(slot, v[:, :, None, :].to(d.values.dtype), d.values))
    return o, torch.where(last, folded, s)


if _HAS_TRITON:

    @triton.jit
    def load_rows(tile, v_ok):
        """The state's rows at ``tile`` (pointers ``[R, BLOCK_V]``) as fp32."""
        return tl.load(tile, mask=v_ok[None, :], other=0.0).to(tl.float32)

    @triton.jit
    def store_rows(tile, s, v_ok):
        """Write fp32 rows ``s`` back (a bf16 state: rounded to nearest even)."""
        tl.store(tile, s.to(tile.dtype.element_ty, fp_downcast_rounding="rtne"), mask=v_ok[None, :])

    @triton.jit
    def held_output(q1, q2, PK, PV, lo, hi, offs_v, v_ok, j, g, DK: tl.constexpr,
                     DV: tl.constexpr, EVERY: tl.constexpr):
        """Σ_{i<j} λ^{j-i} (q·k_i) v_i over the j tokens the row holds (``PK`` ``[EVERY-1, DK]``,
        ``PV`` ``[EVERY-1, DV]``; λ = exp(g)), q in halves ``[DK/2]`` -> ``[BLOCK_V]``."""
        o = tl.zeros(offs_v.shape, tl.float32)
        for i in tl.static_range(EVERY - 1):
            held = i < j
            # masks as comparisons with a bound that is 0 where the slot is not held (a vector
            # mask & a scalar one comes out as ints in Triton's interpreter)
            k1 = tl.load(PK + i * DK + lo, mask=lo < tl.where(held, DK // 2, 0), other=0.0)
            k2 = tl.load(PK + i * DK + hi, mask=hi < tl.where(held, DK, 0), other=0.0)
            vi = tl.load(PV + i * DV + offs_v, mask=offs_v < tl.where(held, DV, 0), other=0.0)
            w = tl.where(held, tl.exp(g * (j - i).to(tl.float32)), 0.0)
            o += (w * (tl.sum(q1 * k1, 0) + tl.sum(q2 * k2, 0))) * vi
        return o

    @triton.jit
    def deferred_rows(tile, q, k, v, PK, PV, offs_k, offs_v, v_ok, j, g, DK: tl.constexpr,
                       DV: tl.constexpr, EVERY: tl.constexpr):
        """Rows ``offs_k`` of a written state's tile ``[DK/2, BLOCK_V]``: their share of
        λ^{j+1} q S₀ ``[BLOCK_V]``; at the row's last held slot (j = EVERY-1), the state with
        every held token and this one folded in, written back."""
        s = load_rows(tile, v_ok)
        o = tl.exp(g * (j + 1).to(tl.float32)) * tl.sum(q[:, None] * s, axis=0)
        if j == EVERY - 1:
            s = tl.exp(g * EVERY) * s + k[:, None] * v[None, :]
            for i in tl.static_range(EVERY - 1):
                ki = tl.load(PK + i * DK + offs_k)
                vi = tl.load(PV + i * DV + offs_v, mask=v_ok, other=0.0)
                s += tl.exp(g * (EVERY - 1 - i)) * ki[:, None] * vi[None, :]
            store_rows(tile, s, v_ok)
        return o

    @triton.jit
    def hold_token(k1, k2, v, PK, PV, lo, hi, offs_v, v_ok, j, first, DK: tl.constexpr,
                    DV: tl.constexpr, EVERY: tl.constexpr):
        """Before its last held slot a row keeps this token's k and v in slot j instead of
        writing its state. Every program of the head has all of k; its ``first`` writes it."""
        if j < EVERY - 1:
            tl.store(PK + j * DK + lo, k1, mask=lo < tl.where(first, DK // 2, 0))
            tl.store(PK + j * DK + hi, k2, mask=hi < tl.where(first, DK, 0))
            tl.store(PV + j * DV + offs_v, v, mask=v_ok)
