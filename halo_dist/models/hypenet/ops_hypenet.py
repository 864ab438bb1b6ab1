"""Kernels behind HypeNet's mixers, dispatched by device.

Self-contained (torch only, fla / flash-attn optional) because exported folders carry this file.

Lightning attention (SPEC §2), per head h with log-decay g_h = -2^(-8h/H):
    S_t = exp(g_t) S_{t-1} + k_tᵀ v_t ,   o_t = scale · q_t S_t
On CUDA with fla installed we call ``chunk_simple_gla`` (train / prefill, varlen via ``cu_seqlens``)
and ``fused_recurrent_simple_gla`` (decode). Elsewhere an exact chunked torch implementation runs;
it is also the reference the GPU path is tested against (tests/test_lightning.py, bench/).

Layout everywhere: q, k, v ``[B, T, H, D]``; recurrent state ``[N, H, K, V]`` (fp32).
"""

from __future__ import annotations

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


def lightning_log_decay(num_heads: int, device=None) -> torch.Tensor:
    """log γ_h = -2^(-8h/H) for h = 1..H, the same in every layer (no layer factor, SPEC §2). [H] fp32."""
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
# Softmax attention with document masking
# --------------------------------------------------------------------------------------------


def segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """int ``[N+1]`` boundaries -> ``[total]`` segment index of every token."""
    marks = torch.zeros(total + 1, dtype=torch.int32, device=cu_seqlens.device)
    marks.index_add_(0, cu_seqlens[1:-1].long(), torch.ones_like(cu_seqlens[1:-1], dtype=torch.int32))
    return marks[:total].cumsum(0)


def packed_causal_attention(q, k, v, cu_seqlens, max_seqlen, scale):
    """Causal attention that never crosses a document boundary.

    q ``[B, T, Hq, D]``, k/v ``[B, T, Hkv, D]`` with ``cu_seqlens`` over the flattened B*T tokens.
    flash-attn varlen on CUDA when installed; otherwise SDPA with a block-diagonal causal mask.
    Returns ``[B, T, Hq, D]``.
    """
    B, T, Hq, D = q.shape
    if _HAS_FLASH_ATTN and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        cu = cu_seqlens.to(torch.int32)
        # [B, T, H, D] -> [B*T, H, D]: flash-attn's varlen layout
        o = flash_attn_varlen_func(
            q.reshape(B * T, Hq, D), k.reshape(B * T, -1, D), v.reshape(B * T, -1, D),
            cu, cu, max_seqlen, max_seqlen, softmax_scale=scale, causal=True,
        )
        return o.view(B, T, Hq, D)
    seg = segment_ids_from_cu_seqlens(cu_seqlens, B * T).view(B, T)
    same_doc = seg[:, :, None] == seg[:, None, :]  # [B, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    mask = (same_doc & causal)[:, None]  # [B, 1, T, T]
    return sdpa(q, k, v, mask=mask, scale=scale)


def sdpa(q, k, v, mask=None, is_causal=False, scale=None):
    """torch SDPA on ``[B, T, H, D]`` tensors with GQA (k/v heads repeated to the query heads)."""
    Hq, Hkv = q.shape[2], k.shape[2]
    if Hq != Hkv:
        k = k.repeat_interleave(Hq // Hkv, dim=2)  # [B, Tk, Hkv, D] -> [B, Tk, Hq, D]
        v = v.repeat_interleave(Hq // Hkv, dim=2)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [B, H, T, D]
        attn_mask=mask, is_causal=is_causal and mask is None, scale=scale,
    )
    return o.transpose(1, 2)  # [B, H, T, D] -> [B, T, H, D]
