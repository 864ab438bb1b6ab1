"""Kernels behind HypeNet's mixers, dispatched by device.

Self-contained (torch only, fla / flash-attn optional) because exported folders carry this file.

Lightning attention, per head h with log-decay g_h = -2^(-8h/H) (``decay="hype"``) or minus ALiBi's
slope of head h (``decay="alibi"``: the same for H a power of two, interleaved otherwise):
    S_t = exp(g_t) S_{t-1} + k_tᵀ v_t ,   o_t = scale · q_t S_t
On CUDA with fla installed we call ``chunk_simple_gla`` (train / prefill, varlen via ``cu_seqlens``)
and ``fused_recurrent_simple_gla`` (decode). Elsewhere an exact chunked torch implementation runs;
it is also the reference the GPU path is tested against (tests/test_lightning.py, bench/).

The sweep mixers share one state convention, S ``[K, V]`` per head
and ``o_t = scale · q_t S_t``:
    GLA     S_t = diag(exp(gk_t)) S_{t-1} + k_t v_tᵀ                       (gk ``[B, T, H, K]``)
    Mamba2  S_t = exp(g_t) S_{t-1} + k_t v_tᵀ                              (g ``[B, T, H]``, SSD form)
    GDN     S_t = exp(g_t) (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ       (g, β ``[B, T, H]``)
    RWKV-7  S_t = diag(exp(w_t)) S_{t-1} + b_t (a_tᵀ S_{t-1}) + k_t v_tᵀ   (w, a, b ``[B, T, H, K]``)
Each has an exact torch reference (naive recurrence; chunked forms where the GPU fallback needs
speed) that keeps float64 inputs in float64, and a dispatcher that calls fla's kernels on CUDA. fla
is imported lazily and guarded: exported model folders must load without it.

fla 0.6.0's ``chunk_bwd_dqkwg`` raises when a gate ``g`` is given on Hopper with 3.4.0 <= Triton <
3.7.1 (fla #640: that Triton miscompiles it). Its callers among our ops are the backward passes of
``chunk_gated_delta_rule`` (GDN) and ``chunk_simple_gla`` with per-token ``g`` (Mamba2). On such
GPUs training falls back (one warning): Mamba2 to fla's ``chunk_gla`` with the per-head decay
broadcast over K (its own backward kernels, same math), GDN to the exact chunked torch form below.
Forward-only calls (inference, prefill, decode) always use the fla kernels.

Layout everywhere: q, k, v ``[B, T, H, D]``; recurrent state ``[N, H, K, V]`` (fp32).
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings

import torch
import torch.nn.functional as F

try:  # fla's Triton kernels: CUDA only
    from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla

    _HAS_FLA = True
except Exception:  # pragma: no cover - depends on the environment
    _HAS_FLA = False

try:  # flash-attn is an optional extra (no binary wheel for every platform; SDPA is the fallback)
    from flash_attn import flash_attn_varlen_func

    _HAS_FLASH_ATTN = True
except Exception:  # pragma: no cover
    _HAS_FLASH_ATTN = False


LIGHTNING_DECAYS = ("hype", "alibi")


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi's per-head slopes (Press et al.): 2^(-8h/n), h = 1..n, for n a power of two; otherwise the
    slopes of the largest power of two p below n, then every other slope of 2p for the remaining heads
    (so they interleave with the first p instead of extending the geometric series)."""
    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    p = 1 << (num_heads.bit_length() - 1)
    if p == num_heads:
        return power_of_two(num_heads)
    return power_of_two(p) + alibi_slopes(2 * p)[0::2][: num_heads - p]


def lightning_log_decay(num_heads: int, device=None, decay: str = "hype") -> torch.Tensor:
    """log γ_h for heads h = 1..H, the same in every layer (no layer factor). [H] fp32.

    ``decay="hype"``: -2^(-8h/H); ``"alibi"``: minus ALiBi's slopes (:func:`alibi_slopes`), the decays of
    the reference HypeNet checkpoints; the two agree exactly when H is a power of two.
    """
    if decay == "alibi":
        return -torch.tensor(alibi_slopes(num_heads), dtype=torch.float64, device=device).to(torch.float32)
    if decay != "hype":
        raise ValueError(f"lightning decay {decay!r} is unknown; choose from {LIGHTNING_DECAYS}")
    h = torch.arange(1, num_heads + 1, dtype=torch.float64, device=device)
    return (-torch.pow(2.0, -8.0 * h / num_heads)).to(torch.float32)


def use_fla(x: torch.Tensor) -> bool:
    return _HAS_FLA and x.is_cuda


# --------------------------------------------------------------------------------------------
# Lightning attention: exact torch implementations (CPU, and the reference for the GPU path)
# --------------------------------------------------------------------------------------------


def lightning_recurrent_torch(q, k, v, g, scale, initial_state=None):
    """Naive per-step recurrence; q/k/v ``[B, T, H, D]``, g ``[B, T, H]`` log-decay per token.

    Returns ``(o [B, T, H, V] in q.dtype, final_state [B, H, K, V] fp32)``.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    state = q.new_zeros(B, H, K, V, dtype=acc) if initial_state is None else initial_state.to(acc)
    qf, kf, vf, gf = q.to(acc), k.to(acc), v.to(acc), g.to(acc)
    outs = []
    for t in range(T):
        decay = gf[:, t].exp()[..., None, None]  # [B, H, 1, 1]
        state = decay * state + kf[:, t, :, :, None] * vf[:, t, :, None, :]  # [B, H, K, V]
        outs.append(torch.einsum("bhk,bhkv->bhv", qf[:, t], state) * scale)
    o = torch.stack(outs, dim=1) if outs else q.new_zeros(B, 0, H, V, dtype=acc)
    return o.to(q.dtype), state


def _chunk_one(q, k, v, g, scale, state, chunk_size):
    """Chunked form for equal-length rows. q/k/v ``[B, T, H, D]`` fp32, g ``[B, T, H]``, state ``[B, H, K, V]``.

    Within a chunk with inclusive cumulative log-decay G:
        o_i = scale · (Σ_{j<=i} exp(G_i - G_j) (q_i·k_j) v_j + exp(G_i) q_i S_prev)
        S_new = exp(G_last) S_prev + Σ_j exp(G_last - G_j) k_jᵀ v_j
    Decay ratios are formed as exp(G_i - G_j) directly, never exp(G_i)·exp(-G_j), so long chunks
    cannot overflow.
    """
    B, T, H, _ = q.shape
    outs = []
    for start in range(0, T, chunk_size):
        end = min(start + chunk_size, T)
        qc, kc, vc = (x[:, start:end].transpose(1, 2) for x in (q, k, v))  # [B, H, C, D]
        G = g[:, start:end].transpose(1, 2).cumsum(-1)  # [B, H, C]
        C = end - start
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        rel = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [B, H, C, C]
        scores = (qc @ kc.transpose(-1, -2)) * rel
        o = scores @ vc + (qc * G.exp()[..., None]) @ state  # [B, H, C, V]
        outs.append(o.transpose(1, 2) * scale)  # [B, C, H, V]
        k_decay = (G[..., -1:] - G).exp()[..., None]  # [B, H, C, 1]
        state = G[..., -1].exp()[..., None, None] * state + (kc * k_decay).transpose(-1, -2) @ vc
    return torch.cat(outs, dim=1), state


def lightning_chunk_torch(q, k, v, g, scale, initial_state=None, cu_seqlens=None, chunk_size=64):
    """Exact chunked Lightning attention in fp32.

    Args:
        q, k, v: ``[B, T, H, D]``; with ``cu_seqlens`` B must be 1 and T the packed length.
        g: ``[B, T, H]`` per-token log-decay (``log γ_h`` broadcast; 0 at padding = identity step).
        initial_state: ``[N, H, K, V]`` with N = B, or N = number of segments with ``cu_seqlens``.
        cu_seqlens: int ``[N+1]`` segment boundaries; the state resets at each boundary.
    Returns ``(o [B, T, H, V] in q.dtype, final_state [N, H, K, V] fp32)``.
    """
    dtype = q.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32  # fp32 at least; fp64 stays fp64 (tests)
    q, k, v, g = q.to(acc), k.to(acc), v.to(acc), g.to(acc)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if cu_seqlens is None:
        state = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(acc)
        o, state = _chunk_one(q, k, v, g, scale, state, chunk_size)
        return o.to(dtype), state
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch must be flattened to B=1, got B={B}")
    bounds = cu_seqlens.tolist()
    outs, states = [], []
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = q.new_zeros(1, H, K, V) if initial_state is None else initial_state[n : n + 1].to(acc)
        o, state = _chunk_one(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], scale, state, chunk_size)
        outs.append(o)
        states.append(state)
    return torch.cat(outs, dim=1).to(dtype), torch.cat(states, dim=0)


def lightning_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    scale: float,
    token_mask: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    decode: bool = False,
):
    """Dispatching entry point. ``log_decay [H]`` per head; ``token_mask [B, T]`` (False = padding).

    Padding tokens become identity steps (k = v = 0, and no decay where a state already exists), so
    a left-padded row ends in exactly the state of the unpadded row. Left padding from an empty state
    keeps the head-constant decay (fla's ``g_gamma`` kernels): fla 0.6 refuses the per-token-gate
    backward on Hopper with Triton < 3.7.1, so the common path must not need it. Returns ``(o [B, T, H, V], final_state [N, H, K, V] fp32)``.
    """
    g = None
    if token_mask is not None:
        m = token_mask[..., None].to(k.dtype)  # [B, T, 1]
        k, v = k * m[..., None], v * m[..., None]
        if initial_state is not None or not _is_left_padded(token_mask):
            # pads after real tokens must not decay the state: per-token g = 0 there. (A zero state
            # stays zero through k = v = 0 steps, so left padding from an empty state needs no g.)
            g = log_decay.to(q.device)[None, None, :] * m.float()  # [B, T, H]
    if use_fla(q):
        state = None if initial_state is None else initial_state.float()
        gamma = None if g is not None else log_decay.to(q.device).float()
        if decode:
            return fused_recurrent_simple_gla(
                q, k, v, g=g, g_gamma=gamma, scale=scale, initial_state=state,
                output_final_state=True, cu_seqlens=cu_seqlens,
            )
        return chunk_simple_gla(
            q, k, v, g=g, g_gamma=gamma, scale=scale, initial_state=state,
            output_final_state=True, cu_seqlens=cu_seqlens,
        )
    if g is None:
        B, T, H, _ = q.shape
        g = log_decay.to(q.device).float()[None, None, :].expand(B, T, H)
    if decode and cu_seqlens is None:
        return lightning_recurrent_torch(q, k, v, g, scale, initial_state)
    return lightning_chunk_torch(q, k, v, g, scale, initial_state, cu_seqlens, chunk_size)


def _is_left_padded(token_mask: torch.Tensor) -> bool:
    """True if no real token is followed by a pad in any row."""
    return not bool((token_mask[:, :-1] & ~token_mask[:, 1:]).any())


# --------------------------------------------------------------------------------------------
# Sweep mixers (GLA, Mamba2, GDN, RWKV-7): fla access, the Hopper guard, shared helpers
# --------------------------------------------------------------------------------------------


def _fla_op(module: str, name: str):
    """Lazily import ``fla.<module>.<name>``; None when fla (or that op) is unavailable."""
    try:
        return getattr(importlib.import_module(f"fla.{module}"), name)
    except Exception:  # pragma: no cover - depends on the environment
        return None


@functools.lru_cache(maxsize=None)
def _fla_gated_backward_broken(device_index: int) -> bool:
    """fla's own refusal condition (fla/ops/common/chunk_o.py::chunk_bwd_dqkwg, fla #640): a gated
    ``chunk_bwd_dqkwg`` on Hopper with 3.4.0 <= Triton < 3.7.1. ``HYPENET_FLA_GATED_BWD=1`` trusts fla
    anyway (e.g. with fla's TileLang/FlashQLA backends installed)."""
    if os.environ.get("HYPENET_FLA_GATED_BWD") == "1":
        return False
    major, _ = torch.cuda.get_device_capability(device_index)
    if not (major == 9 or "NVIDIA H" in torch.cuda.get_device_name(device_index)):
        return False
    try:
        import triton
        from packaging.version import Version

        return Version("3.4.0") <= Version(triton.__version__) < Version("3.7.1")
    except Exception:  # pragma: no cover
        return False


def gated_backward_fallback(x: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    """True when this call needs a backward that fla's gated ``chunk_bwd_dqkwg`` would refuse."""
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *tensors))
    return needs_grad and x.is_cuda and _fla_gated_backward_broken(x.device.index or 0)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _acc(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32 at least, fp64 stays fp64 (exactness tests)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _varlen(fn, cu_seqlens, seq_tensors, initial_state, **kw):
    """Run ``fn(*tensors, initial_state=..., **kw) -> (o, state)`` on each packed document.

    ``seq_tensors`` are ``[1, T, ...]`` when ``cu_seqlens`` is given (the state resets at every
    boundary; ``initial_state`` is ``[N, ...]``), else ``[B, T, ...]`` run as they are.
    """
    if cu_seqlens is None:
        return fn(*seq_tensors, initial_state=initial_state, **kw)
    if seq_tensors[0].shape[0] != 1:
        raise ValueError(f"with cu_seqlens the batch must be flattened to B=1, got B={seq_tensors[0].shape[0]}")
    bounds = cu_seqlens.tolist()
    outs, states = [], []
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        init = None if initial_state is None else initial_state[n : n + 1]
        o, st = fn(*(t[:, s:e] for t in seq_tensors), initial_state=init, **kw)
        outs.append(o)
        states.append(st)
    return torch.cat(outs, dim=1), torch.cat(states, dim=0)


def _zero_state(q: torch.Tensor, v: torch.Tensor, initial_state, acc):
    B, _, H, K = q.shape
    if initial_state is None:
        return q.new_zeros(B, H, K, v.shape[-1], dtype=acc)
    return initial_state.to(acc)


def _causal(C: int, device, strict: bool = False) -> torch.Tensor:
    return torch.ones(C, C, dtype=torch.bool, device=device).tril(-1 if strict else 0)


# --------------------------------------------------------------------------------------------
# GLA (and Mamba2 as its per-head special case): torch references
# --------------------------------------------------------------------------------------------


def gla_recurrent_torch(q, k, v, gk, scale, initial_state=None):
    """Naive GLA recurrence. q/k/gk ``[B, T, H, K]``, v ``[B, T, H, V]`` -> ``(o, state [B, H, K, V])``."""
    acc = _acc(q)
    state = _zero_state(q, v, initial_state, acc)
    qf, kf, vf, gf = (t.to(acc) for t in (q, k, v, gk))
    outs = []
    for t in range(q.shape[1]):
        state = gf[:, t].exp()[..., None] * state + kf[:, t, :, :, None] * vf[:, t, :, None, :]  # [B, H, K, V]
        outs.append(torch.einsum("bhk,bhkv->bhv", qf[:, t], state) * scale)
    o = torch.stack(outs, dim=1) if outs else vf[:, :0]
    return o.to(q.dtype), state


def _gla_chunk_one(q, k, v, gk, scale, initial_state, chunk_size):
    """Chunked GLA for equal-length rows; per-channel decay ratios exp(G_i - G_j) ``[B, H, C, C, K]``
    are formed directly (never exp(G_i)·exp(-G_j)), so any chunk length is overflow-free."""
    acc = _acc(q)
    state = _zero_state(q, v, initial_state, acc)
    q, k, v, gk = (t.to(acc) for t in (q, k, v, gk))
    outs = []
    for start in range(0, q.shape[1], chunk_size):
        end = min(start + chunk_size, q.shape[1])
        qc, kc, vc, gc = (x[:, start:end].transpose(1, 2) for x in (q, k, v, gk))  # [B, H, C, D]
        G = gc.cumsum(2)  # [B, H, C, K] inclusive
        causal = _causal(end - start, q.device)[..., None]  # [C, C, 1]
        rel = (G[:, :, :, None] - G[:, :, None]).masked_fill(~causal, float("-inf")).exp()  # [B, H, C, C, K]
        scores = torch.einsum("bhik,bhjk,bhijk->bhij", qc, kc, rel)
        o = scores @ vc + (qc * G.exp()) @ state  # [B, H, C, V]
        outs.append(o.transpose(1, 2) * scale)  # [B, C, H, V]
        k_decay = (G[:, :, -1:] - G).exp()  # [B, H, C, K]
        state = G[:, :, -1, :, None].exp() * state + (kc * k_decay).transpose(-1, -2) @ vc
    return torch.cat(outs, dim=1), state


def gla_chunk_torch(q, k, v, gk, scale, initial_state=None, cu_seqlens=None, chunk_size=32):
    """Exact chunked GLA (fp32, fp64 kept). Returns ``(o [B, T, H, V] in q.dtype, state [N, H, K, V])``."""
    o, state = _varlen(_gla_chunk_one, cu_seqlens, (q, k, v, gk), initial_state, scale=scale, chunk_size=chunk_size)
    return o.to(q.dtype), state


# --------------------------------------------------------------------------------------------
# Gated DeltaNet: torch references
# --------------------------------------------------------------------------------------------


def gdn_recurrent_torch(q, k, v, g, beta, scale, initial_state=None):
    """Naive gated delta rule (fla's ``naive_recurrent_gated_delta_rule``). q/k ``[B, T, H, K]``,
    v ``[B, T, H, V]``, g (log-decay) and β ``[B, T, H]`` -> ``(o, state [B, H, K, V])``."""
    acc = _acc(q)
    state = _zero_state(q, v, initial_state, acc)
    qf, kf, vf, gf, bf = (t.to(acc) for t in (q, k, v, g, beta))
    outs = []
    for t in range(q.shape[1]):
        state = gf[:, t].exp()[..., None, None] * state  # [B, H, K, V]
        v_old = torch.einsum("bhk,bhkv->bhv", kf[:, t], state)
        delta = bf[:, t, :, None] * (vf[:, t] - v_old)  # [B, H, V]
        state = state + kf[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", qf[:, t], state) * scale)
    o = torch.stack(outs, dim=1) if outs else vf[:, :0]
    return o.to(q.dtype), state


def _gdn_chunk_one(q, k, v, g, beta, scale, initial_state, chunk_size):
    """WY form per chunk. With inclusive cumulative log-decay G and u_j = β_j (v_j - k_jᵀ S_{j-1}'):
        (I + A) U = β V - (β e^G K) S_0,   A_ij = β_i e^{G_i - G_j} k_i·k_j  (j < i)
        o_i = scale (e^{G_i} q_i S_0 + Σ_{j<=i} e^{G_i - G_j} (q_i·k_j) u_j)
        S_C = e^{G_C} S_0 + Σ_j e^{G_C - G_j} k_j u_jᵀ
    solved with one unit-lower-triangular solve per chunk (differentiable)."""
    acc = _acc(q)
    state = _zero_state(q, v, initial_state, acc)
    q, k, v, g, beta = (t.to(acc) for t in (q, k, v, g, beta))
    V, outs = v.shape[-1], []
    for start in range(0, q.shape[1], chunk_size):
        end = min(start + chunk_size, q.shape[1])
        qc, kc, vc = (x[:, start:end].transpose(1, 2) for x in (q, k, v))  # [B, H, C, D]
        G = g[:, start:end].transpose(1, 2).cumsum(-1)  # [B, H, C]
        bc = beta[:, start:end].transpose(1, 2)  # [B, H, C]
        C = end - start
        diff = G[..., :, None] - G[..., None, :]  # [B, H, C, C]
        strict = diff.masked_fill(~_causal(C, q.device, strict=True), float("-inf")).exp()
        incl = diff.masked_fill(~_causal(C, q.device), float("-inf")).exp()
        A = bc[..., None] * (kc @ kc.transpose(-1, -2)) * strict
        eye = torch.eye(C, dtype=acc, device=q.device)
        rhs = torch.cat([bc[..., None] * vc, (bc * G.exp())[..., None] * kc], dim=-1)  # [B, H, C, V+K]
        sol = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        w_v, w_k = sol.split([V, sol.shape[-1] - V], dim=-1)
        u = w_v - w_k @ state  # [B, H, C, V]
        o = ((qc @ kc.transpose(-1, -2)) * incl) @ u + (qc * G.exp()[..., None]) @ state
        outs.append(o.transpose(1, 2) * scale)  # [B, C, H, V]
        k_decay = (G[..., -1:] - G).exp()[..., None]  # [B, H, C, 1]
        state = G[..., -1].exp()[..., None, None] * state + (kc * k_decay).transpose(-1, -2) @ u
    return torch.cat(outs, dim=1), state


def gdn_chunk_torch(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None, chunk_size=64):
    """Exact chunked gated delta rule (fp32, fp64 kept). Returns ``(o in q.dtype, state [N, H, K, V])``."""
    o, state = _varlen(_gdn_chunk_one, cu_seqlens, (q, k, v, g, beta), initial_state, scale=scale, chunk_size=chunk_size)
    return o.to(q.dtype), state


# --------------------------------------------------------------------------------------------
# RWKV-7 (diagonal-plus-low-rank transition): torch reference
# --------------------------------------------------------------------------------------------


def dplr_recurrent_torch(q, k, v, a, b, w, scale, initial_state=None):
    """Naive DPLR recurrence (fla's ``dplr_recurrence`` in [K, V] layout):
        S_t = diag(exp(w_t)) S_{t-1} + b_t (a_tᵀ S_{t-1}) + k_t v_tᵀ,   o_t = scale · q_t S_t
    RWKV-7 uses a = -κ̂, b = κ̂ ⊙ a_rate. q/k/a/b/w ``[B, T, H, K]``, v ``[B, T, H, V]``."""
    acc = _acc(q)
    state = _zero_state(q, v, initial_state, acc)
    qf, kf, vf, af, bf, wf = (t.to(acc) for t in (q, k, v, a, b, w))
    outs = []
    for t in range(q.shape[1]):
        sa = torch.einsum("bhk,bhkv->bhv", af[:, t], state)  # aᵀ S_{t-1}: [B, H, V]
        state = (wf[:, t].exp()[..., None] * state + bf[:, t, :, :, None] * sa[:, :, None, :]
                 + kf[:, t, :, :, None] * vf[:, t, :, None, :])
        outs.append(torch.einsum("bhk,bhkv->bhv", qf[:, t], state) * scale)
    o = torch.stack(outs, dim=1) if outs else vf[:, :0]
    return o.to(q.dtype), state


def dplr_torch(q, k, v, a, b, w, scale, initial_state=None, cu_seqlens=None, chunk_size=None):
    """Varlen wrapper of :func:`dplr_recurrent_torch` (``chunk_size`` ignored: no chunked form)."""
    o, state = _varlen(dplr_recurrent_torch, cu_seqlens, (q, k, v, a, b, w), initial_state, scale=scale)
    return o.to(q.dtype), state


# --------------------------------------------------------------------------------------------
# Dispatchers: fla on CUDA, the torch forms elsewhere. All return (o [B, T, H, V], state fp32 or None)
# --------------------------------------------------------------------------------------------


def _fla_state(initial_state):
    return None if initial_state is None else initial_state.float()


def gla_attention(q, k, v, gk, scale, initial_state=None, cu_seqlens=None, chunk_size=32, decode=False,
                  output_final_state=True):
    """GLA: gk ``[B, T, H, K]`` per-channel log-decay (fp32). fla ``chunk_gla`` / ``fused_recurrent_gla``."""
    if use_fla(q):
        op = _fla_op("ops.gla", "fused_recurrent_gla" if decode else "chunk_gla")
        kw = {"gk": gk} if decode else {"g": gk}
        return op(q, k, v, **kw, scale=scale, initial_state=_fla_state(initial_state),
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if decode and cu_seqlens is None:
        return gla_recurrent_torch(q, k, v, gk, scale, initial_state)
    return gla_chunk_torch(q, k, v, gk, scale, initial_state, cu_seqlens, chunk_size)


def mamba2_attention(q, k, v, g, scale, initial_state=None, cu_seqlens=None, chunk_size=64, decode=False,
                     output_final_state=True):
    """Mamba2 / SSD: g ``[B, T, H]`` per-head per-token log-decay (fp32). fla ``chunk_simple_gla`` with
    ``g``; training on a Hopper GPU that fla refuses falls back to fla ``chunk_gla`` (g broadcast over K)."""
    if use_fla(q):
        state = _fla_state(initial_state)
        if decode:
            op = _fla_op("ops.simple_gla", "fused_recurrent_simple_gla")
        elif gated_backward_fallback(q, k, v, g):
            _warn_once("fla chunk_simple_gla(g=...) cannot run backward on Hopper with Triton < 3.7.1 (fla #640): "
                       "Mamba2 layers train through fla chunk_gla with the decay broadcast over K (same math)")
            gk = g[..., None].expand(*g.shape, q.shape[-1]).contiguous()  # [B, T, H] -> [B, T, H, K]
            return _fla_op("ops.gla", "chunk_gla")(q, k, v, g=gk, scale=scale, initial_state=state,
                                                   output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        else:
            op = _fla_op("ops.simple_gla", "chunk_simple_gla")
        return op(q, k, v, g=g, scale=scale, initial_state=state, output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens)
    if decode and cu_seqlens is None:
        return lightning_recurrent_torch(q, k, v, g, scale, initial_state)
    return lightning_chunk_torch(q, k, v, g, scale, initial_state, cu_seqlens, chunk_size)


def gated_delta_attention(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None, chunk_size=64,
                          decode=False, output_final_state=True):
    """Gated DeltaNet: q/k unit-norm, g log-decay and β ``[B, T, H]``. fla ``chunk_gated_delta_rule`` /
    ``fused_recurrent_gated_delta_rule``; training on a Hopper GPU that fla refuses runs the exact
    chunked torch form (:func:`gdn_chunk_torch`) on the GPU instead."""
    if use_fla(q):
        state = _fla_state(initial_state)
        if decode:
            op = _fla_op("ops.gated_delta_rule", "fused_recurrent_gated_delta_rule")
            return op(q, k, v, g=g, beta=beta, scale=scale, initial_state=state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        if not gated_backward_fallback(q, k, v, g, beta):
            op = _fla_op("ops.gated_delta_rule", "chunk_gated_delta_rule")
            return op(q, k, v, g=g, beta=beta, scale=scale, initial_state=state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        _warn_once("fla chunk_gated_delta_rule cannot run backward on Hopper with Triton < 3.7.1 (fla #640): "
                   "GDN layers train through the chunked torch implementation (slower)")
        return gdn_chunk_torch(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size)
    if decode and cu_seqlens is None:
        return gdn_recurrent_torch(q, k, v, g, beta, scale, initial_state)
    return gdn_chunk_torch(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size)


RWKV7_LOG_DECAY_MIN = -0.6065306597126334  # -exp(-0.5): RWKV-7's bound on the log-decay w


def rwkv7_attention(q, k, v, w, a, b, scale, initial_state=None, cu_seqlens=None, chunk_size=None, decode=False,
                    output_final_state=True):
    """RWKV-7: w ``[B, T, H, K]`` log-decay in [RWKV7_LOG_DECAY_MIN, 0], a = -κ̂, b = κ̂ ⊙ a_rate.
    fla ``chunk_rwkv7`` (DPLR kernels, no gated ``chunk_bwd_dqkwg``) / ``fused_recurrent_rwkv7``."""
    if use_fla(q):
        state = _fla_state(initial_state)
        if decode:
            op = _fla_op("ops.rwkv7", "fused_recurrent_rwkv7")
            return op(q, w, k, v, a, b, scale=scale, initial_state=state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        op = _fla_op("ops.rwkv7", "chunk_rwkv7")
        # the bound licenses fla's 64-token tensor-core chunks (pads carry w = 0: no decay, also safe)
        return op(q, w, k, v, a, b, scale=scale, initial_state=state, output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens, lower_bound=RWKV7_LOG_DECAY_MIN)
    return dplr_torch(q, k, v, a, b, w, scale, initial_state, cu_seqlens)


# --------------------------------------------------------------------------------------------
# Softmax attention with document masking
# --------------------------------------------------------------------------------------------


def segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """int ``[N+1]`` boundaries -> ``[total]`` segment index of every token."""
    marks = torch.zeros(total + 1, dtype=torch.int32, device=cu_seqlens.device)
    marks.index_add_(0, cu_seqlens[1:-1].long(), torch.ones_like(cu_seqlens[1:-1], dtype=torch.int32))
    return marks[:total].cumsum(0)


def local_causal_mask(Tq: int, Tk: int, window: int | None, device) -> torch.Tensor:
    """``[Tq, Tk]`` bool: the Tq queries are the last Tq of the Tk keys; query i sees key j iff
    j <= i and (window is None or i - j < window) (a window of W keeps W keys, itself included)."""
    qi = torch.arange(Tk - Tq, Tk, device=device)[:, None]
    kj = torch.arange(Tk, device=device)[None, :]
    mask = kj <= qi
    if window is not None:
        mask = mask & (qi - kj < window)
    return mask


def packed_causal_attention(q, k, v, cu_seqlens, max_seqlen, scale, window: int | None = None):
    """Causal attention that never crosses a document boundary, optionally within a sliding window.

    q ``[B, T, Hq, D]``, k/v ``[B, T, Hkv, D]`` with ``cu_seqlens`` over the flattened B*T tokens;
    ``window`` W: each query sees itself and the W - 1 previous tokens of its document.
    flash-attn varlen on CUDA when installed; otherwise SDPA with a block-diagonal causal mask.
    Returns ``[B, T, Hq, D]``.
    """
    B, T, Hq, D = q.shape
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and not _HAS_FLASH_ATTN and _flex_usable():
        o = _flex_document_attention(q, k, v, cu_seqlens, scale, window)
        if o is not None:
            return o
    if _HAS_FLASH_ATTN and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        cu = cu_seqlens.to(torch.int32)
        # [B, T, H, D] -> [B*T, H, D]: flash-attn's varlen layout
        o = flash_attn_varlen_func(
            q.reshape(B * T, Hq, D), k.reshape(B * T, -1, D), v.reshape(B * T, -1, D),
            cu, cu, max_seqlen, max_seqlen, softmax_scale=scale, causal=True,
            window_size=(-1, -1) if window is None else (window - 1, 0),
        )
        return o.view(B, T, Hq, D)
    seg = segment_ids_from_cu_seqlens(cu_seqlens, B * T).view(B, T)
    same_doc = seg[:, :, None] == seg[:, None, :]  # [B, T, T]
    mask = (same_doc & local_causal_mask(T, T, window, q.device))[:, None]  # [B, 1, T, T]
    return sdpa(q, k, v, mask=mask, scale=scale)


def rows_cu_seqlens(batch: int, seq_len: int, device) -> torch.Tensor:
    """int32 ``[B+1]`` boundaries of B unpacked rows of T tokens (each row one document)."""
    return torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=device)


def sdpa(q, k, v, mask=None, is_causal=False, scale=None):
    """torch SDPA on ``[B, T, H, D]`` tensors with GQA. On CUDA without a mask, ``enable_gqa`` lets the
    flash kernel read the shared k/v heads in place; otherwise k/v heads are repeated to the query heads."""
    Hq, Hkv = q.shape[2], k.shape[2]
    if Hq != Hkv and mask is None and q.is_cuda:
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [B, H, T, D]
            is_causal=is_causal, scale=scale, enable_gqa=True,
        )
        return o.transpose(1, 2)  # [B, H, T, D] -> [B, T, H, D]
    if Hq != Hkv:
        k = k.repeat_interleave(Hq // Hkv, dim=2)  # [B, Tk, Hkv, D] -> [B, Tk, Hq, D]
        v = v.repeat_interleave(Hq // Hkv, dim=2)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [B, H, T, D]
        attn_mask=mask, is_causal=is_causal and mask is None, scale=scale,
    )
    return o.transpose(1, 2)  # [B, H, T, D] -> [B, T, H, D]


# ---- FlexAttention: packed (document-masked) causal attention on CUDA without flash-attn ----------
# SDPA with an explicit [T, T] mask cannot use its flash kernel; FlexAttention compiles a block-sparse
# kernel that skips blocks across documents, above the diagonal and outside the window. The block mask
# depends only on cu_seqlens (and the window), which every layer of one forward (and its recomputation)
# shares, so the last few are kept.
_FLEX: dict = {"fn": None, "failed": False, "masks": []}


def _flex_usable() -> bool:
    if _FLEX["failed"]:
        return False
    if _FLEX["fn"] is None:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            # default dynamic=None: static for the first shape, then one dynamic-shape recompile (OPD
            # batches change length every step; dynamic=False would recompile per length up to the limit)
            _FLEX["fn"] = torch.compile(flex_attention)
        except Exception:  # pragma: no cover - old torch
            _FLEX["failed"] = True
            return False
    return True


def document_block_mask(cu_seqlens: torch.Tensor, B: int, T: int, window: int | None,
                        block_size: int = 128):
    """FlexAttention ``BlockMask`` of document-causal (optionally windowed) attention over ``[B, T]`` packed rows,
    built from the document boundaries alone in O((T / block_size)^2) memory.

    ``create_block_mask`` evaluates the mask on a dense ``[T, T]`` grid first: 64 GiB at 256K tokens. Here the
    block structure is computed directly. A query block ``[q_lo, q_hi]`` attends keys ``[lb(q_lo), q_hi]`` (the union
    of its queries' ranges, contiguous because the lower bound ``lb(q) = max(doc_start(q), q - W + 1)`` never
    decreases). A block is *full* (no mask needed) when its keys all precede its queries, query and key ends share a
    document (document ids never decrease within a row) and the window covers the farthest pair; every other
    visited block is *partial* and runs ``mask_mod``. Blocks cut by the sequence end are kept partial."""
    from torch.nn.attention.flex_attention import BlockMask

    dev = cu_seqlens.device
    seg = segment_ids_from_cu_seqlens(cu_seqlens, B * T).view(B, T)  # [B, T] document id per token
    pos = torch.arange(T, device=dev)
    is_start = torch.ones(B, T, dtype=torch.bool, device=dev)
    is_start[:, 1:] = seg[:, 1:] != seg[:, :-1]
    doc_start = torch.where(is_start, pos, 0).cummax(dim=1).values  # [B, T] first position of each token's document
    lower = doc_start if window is None else torch.maximum(doc_start, pos - window + 1)  # [B, T] first visible key

    n = -(-T // block_size)
    starts = torch.arange(n, device=dev) * block_size  # [n] first token of each block
    ends = torch.clamp(starts + block_size - 1, max=T - 1)  # [n] last token of each block
    qi, kj = starts[:, None] // block_size, starts[None, :] // block_size  # [n, 1], [1, n] block indices
    first_kv_block = lower[:, starts] // block_size  # [B, n] first key block each query block visits
    visited = (kj <= qi) & (kj >= first_kv_block[:, :, None])  # [B, n, n]
    full = (ends[None, :] < starts[:, None]) & (seg[:, ends][:, :, None] == seg[:, starts][:, None, :])  # [B, n, n]
    if window is not None:
        full = full & (ends[:, None] - starts[None, :] < window)
    if T % block_size:
        cut = torch.zeros(n, dtype=torch.bool, device=dev)
        cut[-1] = True  # the last block is shorter than block_size: let mask_mod handle it
        full = full & ~cut[:, None] & ~cut[None, :]
    full = full & visited
    partial = visited & ~full

    def ordered(blocks: torch.Tensor):  # [B, n, n] bool -> counts [B, 1, n], indices [B, 1, n, n] (true ones first)
        counts = blocks.sum(-1, dtype=torch.int32)
        order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts[:, None], order[:, None]

    def doc_causal(b, h, q_idx, kv_idx):
        keep = (q_idx >= kv_idx) & (seg[b, q_idx] == seg[b, kv_idx])
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        return keep

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=doc_causal, seq_lengths=(T, T))


def _document_block_mask(cu_seqlens: torch.Tensor, B: int, T: int, window: int | None):
    # An entry holds the cu_seqlens tensor itself, so its memory cannot be reused by another batch's
    # boundaries while cached: identity + version + shape + window identify the content.
    for entry in _FLEX["masks"]:
        if entry[0] is cu_seqlens and entry[1:4] == (cu_seqlens._version, B, T) and entry[4] == window:
            return entry[5]
    mask = document_block_mask(cu_seqlens, B, T, window)
    _FLEX["masks"] = [(cu_seqlens, cu_seqlens._version, B, T, window, mask)] + _FLEX["masks"][:1]
    return mask


def _flex_document_attention(q, k, v, cu_seqlens, scale, window: int | None = None):
    """q ``[B, T, Hq, D]``, k/v ``[B, T, Hkv, D]`` -> ``[B, T, Hq, D]``; GQA without copying k/v."""
    B, T, Hq, _ = q.shape
    try:
        mask = _document_block_mask(cu_seqlens, B, T, window)
        o = _FLEX["fn"](q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [B, H, T, D]
                        block_mask=mask, scale=scale, enable_gqa=Hq != k.shape[2])
    except Exception as err:  # pragma: no cover - compiler trouble: the dense-mask SDPA path still works
        import warnings

        warnings.warn(f"FlexAttention failed ({type(err).__name__}: {err}); using SDPA with a dense mask")
        _FLEX["failed"] = True
        return None
    return o.transpose(1, 2)  # [B, H, T, D] -> [B, T, H, D]


def chunk_prefill_attention(q, k, v, scale):
    """Causal attention of ``Tq`` new queries over ``Tk >= Tq`` keys whose last ``Tq`` are the queries'
    own (chunked prefill): query i sees keys ``<= Tk - Tq + i``. q ``[B, Tq, H, D]`` -> ``[B, Tq, H, D]``.
    CUDA: SDPA's lower-right causal bias (flash kernel, no [Tq, Tk] mask); elsewhere an explicit mask."""
    Tq, Tk = q.shape[1], k.shape[1]
    if q.is_cuda:
        from torch.nn.attention.bias import causal_lower_right

        Hq, Hkv = q.shape[2], k.shape[2]
        if Hq != Hkv:
            k = k.repeat_interleave(Hq // Hkv, dim=2)  # [B, Tk, Hkv, D] -> [B, Tk, Hq, D]
            v = v.repeat_interleave(Hq // Hkv, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [B, H, T, D]
                                           attn_mask=causal_lower_right(Tq, Tk), scale=scale)
        return o.transpose(1, 2)  # [B, H, Tq, D] -> [B, Tq, H, D]
    causal = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
    return sdpa(q, k, v, mask=causal[None, None], scale=scale)
