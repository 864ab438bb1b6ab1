"""Kernel dispatch behind HypeNet's RNN mixers: fla's Triton kernels on CUDA, the exact torch forms
of ops_rnn_torch.py elsewhere.

Lightning attention, per head h with log-decay g_h = -2^(-8h/H) (``decay="hype"``) or minus ALiBi's
slope of head h (``decay="alibi"``: the same for H a power of two, interleaved otherwise):
    S_t = exp(g_t) S_{t-1} + k_tᵀ v_t ,   o_t = scale · q_t S_t
On CUDA with fla installed we call ``chunk_simple_gla`` (train / prefill, varlen via ``cu_seqlens``)
and ``fused_recurrent_simple_gla`` (decode).

The sweep mixers (GLA, Mamba2, GDN, RWKV-7; their recurrences in ops_rnn_torch.py) have one
dispatcher each that calls fla's kernels on CUDA. fla is imported lazily and guarded: exported model
folders must load without it.

fla 0.6.0's ``chunk_bwd_dqkwg`` raises when a gate ``g`` is given on Hopper with 3.4.0 <= Triton <
3.7.1 (fla #640: that Triton miscompiles it). Its callers among our ops are the backward passes of
``chunk_gated_delta_rule`` (GDN) and ``chunk_simple_gla`` with per-token ``g`` (Mamba2). On such
GPUs training falls back (one warning): Mamba2 to fla's ``chunk_gla`` with the per-head decay
broadcast over K (its own backward kernels, same math), GDN to the exact chunked torch form.
Forward-only calls (inference, prefill, decode) always use the fla kernels.

Exported with every checkpoint: torch only (fla optional).
Layout everywhere: q, k, v ``[B, T, H, D]``; recurrent state ``[N, H, K, V]`` (fp32).
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings

import torch

from .ops_rnn_torch import (
    dplr_torch,
    gdn_chunk_torch,
    gdn_recurrent_torch,
    gla_chunk_torch,
    gla_recurrent_torch,
    lightning_chunk_torch,
    lightning_recurrent_torch,
)

# fla's Triton kernels run only on CUDA tensors. Importing fla takes ~3.5 s, which every process on
# a machine without a GPU (CPU runs, tests, a launcher refusing a bad config) would pay for nothing.
_HAS_FLA = False
if torch.cuda.is_available():
    try:
        from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla

        _HAS_FLA = True
    except Exception:  # pragma: no cover - depends on the environment
        pass

LIGHTNING_DECAYS = ("hype", "alibi")


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi's per-head slopes (Press et al.): 2^(-8h/n), h = 1..n, for n a power of two; otherwise
    the slopes of the largest power of two p below n, then every other slope of 2p for the remaining
    heads (so they interleave with the first p instead of extending the geometric series)."""
    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    p = 1 << (num_heads.bit_length() - 1)
    if p == num_heads:
        return power_of_two(num_heads)
    return power_of_two(p) + alibi_slopes(2 * p)[0::2][: num_heads - p]


def lightning_log_decay(num_heads: int, device=None, decay: str = "hype") -> torch.Tensor:
    """log γ_h for heads h = 1..H, the same in every layer (no layer factor). [H] fp32.

    ``decay="hype"``: -2^(-8h/H); ``"alibi"``: minus ALiBi's slopes (:func:`alibi_slopes`), the
    decays of the reference HypeNet checkpoints; the two agree exactly when H is a power of two.
    """
    if decay == "alibi":
        return -torch.tensor(alibi_slopes(num_heads), dtype=torch.float64,
                             device=device).to(torch.float32)
    if decay != "hype":
        raise ValueError(f"lightning decay {decay!r} is unknown; choose from {LIGHTNING_DECAYS}")
    h = torch.arange(1, num_heads + 1, dtype=torch.float64, device=device)
    return (-torch.pow(2.0, -8.0 * h / num_heads)).to(torch.float32)


def use_fla(x: torch.Tensor) -> bool:
    return _HAS_FLA and x.is_cuda


# --------------------------------------------------------------------------------------------
# Lightning attention
# --------------------------------------------------------------------------------------------



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
    a left-padded row ends in exactly the state of the unpadded row. Left padding from an empty
    state keeps the head-constant decay (fla's ``g_gamma`` kernels): fla 0.6 refuses the
    per-token-gate backward on Hopper with Triton < 3.7.1, so the common path must not need it.
    Returns ``(o [B, T, H, V], final_state [N, H, K, V] fp32)``.
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
# Sweep mixers (GLA, Mamba2, GDN, RWKV-7): fla access and the Hopper guard
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
    ``chunk_bwd_dqkwg`` on Hopper with 3.4.0 <= Triton < 3.7.1. ``HYPENET_FLA_GATED_BWD=1`` trusts
    fla anyway (e.g. with fla's TileLang/FlashQLA backends installed)."""
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
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                 for t in (x, *tensors))
    return needs_grad and x.is_cuda and _fla_gated_backward_broken(x.device.index or 0)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


# --------------------------------------------------------------------------------------------
# Dispatchers: fla on CUDA, the torch forms elsewhere. All return (o [B, T, H, V], state fp32 or
# None)
# --------------------------------------------------------------------------------------------


def _fla_state(initial_state):
    return None if initial_state is None else initial_state.float()


def gla_attention(q, k, v, gk, scale, initial_state=None, cu_seqlens=None, chunk_size=32,
                  decode=False, output_final_state=True):
    """GLA: gk ``[B, T, H, K]`` per-channel log-decay (fp32). fla ``chunk_gla`` /
    ``fused_recurrent_gla``."""
    if use_fla(q):
        op = _fla_op("ops.gla", "fused_recurrent_gla" if decode else "chunk_gla")
        kw = {"gk": gk} if decode else {"g": gk}
        return op(q, k, v, **kw, scale=scale, initial_state=_fla_state(initial_state),
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if decode and cu_seqlens is None:
        return gla_recurrent_torch(q, k, v, gk, scale, initial_state)
    return gla_chunk_torch(q, k, v, gk, scale, initial_state, cu_seqlens, chunk_size)


def mamba2_attention(q, k, v, g, scale, initial_state=None, cu_seqlens=None, chunk_size=64,
                     decode=False, output_final_state=True):
    """Mamba2 / SSD: g ``[B, T, H]`` per-head per-token log-decay (fp32). fla ``chunk_simple_gla``
    with ``g``; training on a Hopper GPU that fla refuses falls back to fla ``chunk_gla`` (g
    broadcast over K)."""
    if use_fla(q):
        state = _fla_state(initial_state)
        if decode:
            op = _fla_op("ops.simple_gla", "fused_recurrent_simple_gla")
        elif gated_backward_fallback(q, k, v, g):
            _warn_once("fla chunk_simple_gla(g=...) cannot run backward on Hopper with Triton < "
                       "3.7.1 (fla #640): Mamba2 layers train through fla chunk_gla with the decay "
                       "broadcast over K (same math)")
            # [B, T, H] -> [B, T, H, K]
            gk = g[..., None].expand(*g.shape, q.shape[-1]).contiguous()
            return _fla_op("ops.gla", "chunk_gla")(q, k, v, g=gk, scale=scale, initial_state=state,
                                                   output_final_state=output_final_state,
                                                   cu_seqlens=cu_seqlens)
        else:
            op = _fla_op("ops.simple_gla", "chunk_simple_gla")
        return op(q, k, v, g=g, scale=scale, initial_state=state,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if decode and cu_seqlens is None:
        return lightning_recurrent_torch(q, k, v, g, scale, initial_state)
    return lightning_chunk_torch(q, k, v, g, scale, initial_state, cu_seqlens, chunk_size)


def gated_delta_attention(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None,
                          chunk_size=64, decode=False, output_final_state=True):
    """Gated DeltaNet: q/k unit-norm, g log-decay and β ``[B, T, H]``. fla
    ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``; training on a Hopper GPU that
    fla refuses runs the exact chunked torch form (:func:`gdn_chunk_torch`) on the GPU instead."""
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
        _warn_once("fla chunk_gated_delta_rule cannot run backward on Hopper with Triton < 3.7.1 "
                   "(fla #640): GDN layers train through the chunked torch implementation (slower)")
        return gdn_chunk_torch(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size)
    if decode and cu_seqlens is None:
        return gdn_recurrent_torch(q, k, v, g, beta, scale, initial_state)
    return gdn_chunk_torch(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size)


RWKV7_LOG_DECAY_MIN = -0.6065306597126334  # -exp(-0.5): RWKV-7's bound on the log-decay w


def rwkv7_attention(q, k, v, w, a, b, scale, initial_state=None, cu_seqlens=None, chunk_size=None,
                    decode=False, output_final_state=True):
    """RWKV-7: w ``[B, T, H, K]`` log-decay in [RWKV7_LOG_DECAY_MIN, 0], a = -κ̂, b = κ̂ ⊙ a_rate.
    fla ``chunk_rwkv7`` (DPLR kernels, no gated ``chunk_bwd_dqkwg``) / ``fused_recurrent_rwkv7``."""
    if use_fla(q):
        state = _fla_state(initial_state)
        if decode:
            op = _fla_op("ops.rwkv7", "fused_recurrent_rwkv7")
            return op(q, w, k, v, a, b, scale=scale, initial_state=state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        op = _fla_op("ops.rwkv7", "chunk_rwkv7")
        # the bound licenses fla's 64-token tensor-core chunks (pads carry w = 0: no decay, also
        # safe)
        return op(q, w, k, v, a, b, scale=scale, initial_state=state,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                  lower_bound=RWKV7_LOG_DECAY_MIN)
    return dplr_torch(q, k, v, a, b, w, scale, initial_state, cu_seqlens)
