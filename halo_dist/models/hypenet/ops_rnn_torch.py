"""Exact torch implementations of HypeNet's RNN recurrences: the CPU path of the ops_rnn
dispatchers, their fallback where fla cannot run, and the references the fla kernels are tested
against (tests/test_lightning.py, tests/test_mixers.py, bench/).

State convention, per head: S ``[K, V]``, ``o_t = scale · q_t S_t``, with per-token log-decays
    Lightning / Mamba2  S_t = exp(g_t) S_{t-1} + k_t v_tᵀ  (g ``[B, T, H]``)
    GLA                 S_t = diag(exp(gk_t)) S_{t-1} + k_t v_tᵀ  (gk ``[B, T, H, K]``)
    GDN                 S_t = exp(g_t) (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ
                        (g, β ``[B, T, H]``)
    RWKV-7 (DPLR)       S_t = diag(exp(w_t)) S_{t-1} + b_t (a_tᵀ S_{t-1}) + k_t v_tᵀ
                        (w, a, b ``[B, T, H, K]``)
Each has a naive recurrence (decode and tests) and, where the GPU fallback needs speed, a chunked
form. float64 inputs stay float64 (the exactness tests); everything else accumulates in fp32.

Exported with every checkpoint: torch only. Layout: q, k, v ``[B, T, H, D]``; state ``[N, H, K, V]``
fp32.
"""

from __future__ import annotations

import torch

# --------------------------------------------------------------------------------------------
# Lightning attention (and Mamba2: the same recurrence with per-token decays)
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
    """Chunked form for equal-length rows. q/k/v ``[B, T, H, D]`` fp32, g ``[B, T, H]``, state
    ``[B, H, K, V]``.

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
        # [B, H, C, C]
        rel = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
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
    dtype, acc = q.dtype, _acc(q)
    q, k, v, g = q.to(acc), k.to(acc), v.to(acc), g.to(acc)
    o, state = _varlen(_lightning_chunk_one, cu_seqlens, (q, k, v, g), initial_state, scale=scale,
                       chunk_size=chunk_size)
    return o.to(dtype), state


def _lightning_chunk_one(q, k, v, g, scale, initial_state=None, chunk_size=64):
    """:func:`_chunk_one` from ``initial_state`` (zeros when None), in ``_varlen``'s signature."""
    return _chunk_one(q, k, v, g, scale, _zero_state(q, v, initial_state, q.dtype), chunk_size)


# --------------------------------------------------------------------------------------------
# Shared helpers of the sweep mixers' references
# --------------------------------------------------------------------------------------------


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
        raise ValueError("with cu_seqlens the batch must be flattened to B=1, got "
                         f"B={seq_tensors[0].shape[0]}")
    return _per_document(fn, cu_seqlens, seq_tensors, initial_state, **kw)


# The loop reads the boundaries on the host: traced by torch.compile (model.compile on CPU, where
# these references run), every new number or length of documents in a micro-batch would compile
# the loop again, so it runs eagerly between the compiled parts of a layer.
@torch.compiler.disable(reason="a Python loop over host-read document boundaries")
def _per_document(fn, cu_seqlens, seq_tensors, initial_state, **kw):
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
    """Naive GLA recurrence. q/k/gk ``[B, T, H, K]``, v ``[B, T, H, V]`` ->
    ``(o, state [B, H, K, V])``."""
    acc = _acc(q)
    state = _zero_state(q, v, initial_state, acc)
    qf, kf, vf, gf = (t.to(acc) for t in (q, k, v, gk))
    outs = []
    for t in range(q.shape[1]):
        # [B, H, K, V]
        state = gf[:, t].exp()[..., None] * state + kf[:, t, :, :, None] * vf[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", qf[:, t], state) * scale)
    o = torch.stack(outs, dim=1) if outs else vf[:, :0]
    return o.to(q.dtype), state


def _gla_chunk_one(q, k, v, gk, scale, initial_state, chunk_size):
    """Chunked GLA for equal-length rows; per-channel decay ratios exp(G_i - G_j)
    ``[B, H, C, C, K]`` are formed directly (never exp(G_i)·exp(-G_j)), so any chunk length is
    overflow-free."""
    acc = _acc(q)
    state = _zero_state(q, v, initial_state, acc)
    q, k, v, gk = (t.to(acc) for t in (q, k, v, gk))
    outs = []
    for start in range(0, q.shape[1], chunk_size):
        end = min(start + chunk_size, q.shape[1])
        qc, kc, vc, gc = (x[:, start:end].transpose(1, 2) for x in (q, k, v, gk))  # [B, H, C, D]
        G = gc.cumsum(2)  # [B, H, C, K] inclusive
        causal = _causal(end - start, q.device)[..., None]  # [C, C, 1]
        # [B, H, C, C, K]
        rel = (G[:, :, :, None] - G[:, :, None]).masked_fill(~causal, float("-inf")).exp()
        scores = torch.einsum("bhik,bhjk,bhijk->bhij", qc, kc, rel)
        o = scores @ vc + (qc * G.exp()) @ state  # [B, H, C, V]
        outs.append(o.transpose(1, 2) * scale)  # [B, C, H, V]
        k_decay = (G[:, :, -1:] - G).exp()  # [B, H, C, K]
        state = G[:, :, -1, :, None].exp() * state + (kc * k_decay).transpose(-1, -2) @ vc
    return torch.cat(outs, dim=1), state


def gla_chunk_torch(q, k, v, gk, scale, initial_state=None, cu_seqlens=None, chunk_size=32):
    """Exact chunked GLA (fp32, fp64 kept). Returns ``(o [B, T, H, V] in q.dtype, state [N, H, K,
    V])``."""
    o, state = _varlen(_gla_chunk_one, cu_seqlens, (q, k, v, gk), initial_state, scale=scale,
                       chunk_size=chunk_size)
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
        # [B, H, C, V+K]
        rhs = torch.cat([bc[..., None] * vc, (bc * G.exp())[..., None] * kc], dim=-1)
        sol = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        w_v, w_k = sol.split([V, sol.shape[-1] - V], dim=-1)
        u = w_v - w_k @ state  # [B, H, C, V]
        o = ((qc @ kc.transpose(-1, -2)) * incl) @ u + (qc * G.exp()[..., None]) @ state
        outs.append(o.transpose(1, 2) * scale)  # [B, C, H, V]
        k_decay = (G[..., -1:] - G).exp()[..., None]  # [B, H, C, 1]
        state = G[..., -1].exp()[..., None, None] * state + (kc * k_decay).transpose(-1, -2) @ u
    return torch.cat(outs, dim=1), state


def gdn_chunk_torch(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None, chunk_size=64):
    """Exact chunked gated delta rule (fp32, fp64 kept). Returns
    ``(o in q.dtype, state [N, H, K, V])``."""
    o, state = _varlen(_gdn_chunk_one, cu_seqlens, (q, k, v, g, beta), initial_state, scale=scale,
                       chunk_size=chunk_size)
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
    o, state = _varlen(dplr_recurrent_torch, cu_seqlens, (q, k, v, a, b, w), initial_state,
                       scale=scale)
    return o.to(q.dtype), state
