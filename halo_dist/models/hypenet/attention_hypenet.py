"""HypeNet's softmax-attention mixers: the teacher's GQA attention (HyPE: NoPE, logits scaling,
output gate) and sliding-window attention. Kernels are in ops_attention.py; under Ulysses sequence
parallelism the same forward runs between ``sp_scatter`` and ``sp_gather``
(sequence_parallel_hypenet.py).

Exported with every checkpoint: torch and transformers only.
"""

from __future__ import annotations

import torch
from torch import nn

from .configuration_hypenet import HypeNetConfig
from .layers_hypenet import (
    HypeNetRMSNorm,
    PackedLinears,
    SequenceInfo,
    apply_rope,
    linear_outputs,
    output_gate,
    output_linear,
    packed_for,
    per_head_rms_norm,
)
from .ops_attention import (chunk_prefill_attention, local_causal_mask, packed_causal_attention,
                            rows_cu_seqlens, sdpa)
from .sequence_parallel_hypenet import SequenceParallelMixer


class HypeNetAttention(SequenceParallelMixer, nn.Module):
    """The teacher's GQA softmax attention, HyPE side: NoPE by default, QK-norm kept, logits scaling
    s_t applied to q before the kernel (so flash/SDPA still apply), optional sigmoid output gate."""

    def __init__(self, config: HypeNetConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        d, H, Hkv, D = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                        config.head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = H, Hkv, D
        self.q_proj = nn.Linear(d, H * D, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, Hkv * D, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, Hkv * D, bias=config.qkv_bias)
        self.o_proj = nn.Linear(H * D, d, bias=config.o_bias)
        if config.attn_qk_norm:
            self.q_norm = HypeNetRMSNorm(D, config.rms_norm_eps)
            self.k_norm = HypeNetRMSNorm(D, config.rms_norm_eps)
        if config.attn_output_gate:
            self.g_proj = nn.Linear(d, H * D, bias=False)
        if config.attn_output_norm:
            self.o_norm = HypeNetRMSNorm(H * D, config.rms_norm_eps)

    # q/k positional treatment, read from the config at forward time (calibrate-scaling changes the
    # base)
    @property
    def rope(self) -> bool:
        return self.config.attn_rope

    @property
    def logits_scale_base(self) -> float | None:
        return self.config.attn_logits_scale_base

    def input_linears(self) -> list[nn.Linear]:
        """q, k, v (and the output gate's) projections, which all read the mixer's input."""
        gate = [self.g_proj] if self.config.attn_output_gate else []
        return [self.q_proj, self.k_proj, self.v_proj, *gate]

    def project(self, x: torch.Tensor, info: SequenceInfo, packed: PackedLinears | None = None):
        """x ``[B, T, d]`` -> q ``[B, T, H, D]``, k/v ``[B, T, Hkv, D]`` with norms, RoPE and
        scaling, and the output gate's logits ``[B, T, H*D]`` when ``packed`` computed them in the
        same GEMM (else None)."""
        B, T, _ = x.shape
        D, cfg = self.head_dim, self.config
        # q, k, v (+ the gate, computed here only in the packed GEMM)
        linears = self.input_linears()
        q, k, v, *g = linear_outputs(x, linears if packed is not None else linears[:3], packed)
        q = q.view(B, T, -1, D)  # [B, T, H*D] -> [B, T, H, D]
        k = k.view(B, T, -1, D)  # [B, T, Hkv*D] -> [B, T, Hkv, D]
        v = v.view(B, T, -1, D)
        if cfg.attn_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            cos, sin = info.rope(D, cfg.rope_theta, q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.logits_scale_base is not None:
            q = (q.float() * info.logits_scale(self.logits_scale_base)).to(v.dtype)
        return q, k, v, (g[0] if g else None)

    def forward(self, x: torch.Tensor, info: SequenceInfo, cache=None):
        """x ``[B, T, d]`` -> ``[B, T, d]``. ``cache``: a HypeNetCache (decoding) or a
        StaticDecodeCache. Under sequence parallelism T is this rank's T/sp tokens and the kernel
        attends over all T tokens of H/sp heads."""
        # q [B, T, H, D], k/v [B, T, Hkv, D]
        packed = packed_for(cache, self.layer_idx, "mixer")
        q, k, v, g = self.project(x, info, packed)
        info = self.sp_enter(info, cache)  # SP: the full sequence's layout
        # SP: [B, T/sp, Hkv, D] -> [B, T/sp, Hkv*f, D], sp | Hkv*f
        k, v = self.sp_replicate_kv(k, v)
        q, k, v = self.sp_scatter(q, k, v)  # SP: [B, T/sp, heads, D] -> [B, T, heads/sp, D]
        scale = self.head_dim**-0.5
        if cache is not None:
            o = self._attend_with_cache(q, k, v, info, cache, scale)
        else:
            o = self._attend(q, k, v, info, scale)
        # SP: [B, T, H/sp, D] -> [B, T/sp, H, D]
        return self.finish(self.sp_gather(o), x, g, packed)

    def _attend(self, q, k, v, info: SequenceInfo, scale: float):
        if info.cu_seqlens is not None:
            return packed_causal_attention(q, k, v, info.cu_seqlens, info.max_seqlen, scale)
        if info.token_mask is not None:  # padded batch without cache: causal + key padding
            T = q.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
            mask = causal[None, None] & info.token_mask[:, None, None, :]  # [B, 1, T, T]
            # padded queries see everything (no NaN)
            mask = mask | ~info.token_mask[:, None, :, None]
            return sdpa(q, k, v, mask=mask, scale=scale)
        return sdpa(q, k, v, is_causal=True, scale=scale)

    def _attend_with_cache(self, q, k, v, info: SequenceInfo, cache, scale: float):
        # StaticDecodeCache: fixed buffers, device-side position
        if getattr(cache, "is_static", False):
            return cache.decode_attention(self.layer_idx, q, k, v, scale)
        past = cache.layers[self.layer_idx]
        k, v = cache.append_kv(self.layer_idx, k, v)  # [B, Tpast+T, Hkv, D]
        Tq, Tk = q.shape[1], k.shape[1]
        if info.key_mask is None:
            # no padding: prefill is plain causal attention (flash kernels, no [Tq, Tk] mask), a
            # single new query attends to every cached key, a prefill chunk is lower-right causal
            if past is None or Tq == 1:
                return sdpa(q, k, v, is_causal=past is None, scale=scale)
            return chunk_prefill_attention(q, k, v, scale)
        # left padding: causal over the cached + new keys, pad keys masked
        causal = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
        mask = causal[None, None] & info.key_mask[:, None, None, :]  # [B, 1, Tq, Tk]
        mask = mask | ~info.key_mask[:, None, -Tq:, None]  # padded queries: avoid all-masked rows
        return sdpa(q, k, v, mask=mask, scale=scale)

    def finish(self, o: torch.Tensor, x: torch.Tensor, gate_logits: torch.Tensor | None = None,
               packed: PackedLinears | None = None) -> torch.Tensor:
        """Optional per-head norm and output gate, then W_o (through ``packed`` when decoding). o
        ``[B, T, H, D]`` -> ``[B, T, d]``."""
        B, T, H, D = o.shape
        if self.config.attn_output_norm:
            o = per_head_rms_norm(o, self.o_norm.weight, self.config.rms_norm_eps)
        else:
            o = o.reshape(B, T, H * D)  # [B, T, H, D] -> [B, T, H*D]
        if self.config.attn_output_gate:
            o = o * output_gate(x, self.g_proj, self.config.output_gate_scale, gate_logits)
        return output_linear(self.o_proj, o, packed)


class SlidingWindowAttention(HypeNetAttention):
    """Softmax attention over the last ``config.sliding_window`` tokens of the query's document
    (SWAN-GPT's local layers): RoPE if ``config.swa_rope``, no logits scaling, the attention layer's
    QK-norm / output gate / output norm switches. The decode cache keeps only the last W - 1
    keys."""

    def __init__(self, config: HypeNetConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.window = int(config.sliding_window)

    @property
    def rope(self) -> bool:
        return self.config.swa_rope

    @property
    def logits_scale_base(self) -> None:  # local layers never scale their logits
        return None

    def _attend(self, q, k, v, info: SequenceInfo, scale: float):
        B, T = q.shape[:2]
        if info.cu_seqlens is not None:
            return packed_causal_attention(q, k, v, info.cu_seqlens, info.max_seqlen, scale,
                                           self.window)
        if info.token_mask is not None:  # padded batch without cache: causal window + key padding
            mask = (local_causal_mask(T, T, self.window, q.device)[None, None]
                    & info.token_mask[:, None, None, :])
            # padded queries see everything (no NaN)
            mask = mask | ~info.token_mask[:, None, :, None]
            return sdpa(q, k, v, mask=mask, scale=scale)  # mask [B, 1, T, T]
        if self.window >= T:
            return sdpa(q, k, v, is_causal=True, scale=scale)
        # each row is one document: the varlen kernels apply the window without a [T, T] mask
        return packed_causal_attention(q, k, v, rows_cu_seqlens(B, T, q.device), T, scale,
                                       self.window)

    def _attend_with_cache(self, q, k, v, info: SequenceInfo, cache, scale: float):
        past = cache.layers[self.layer_idx]
        if past is not None:
            # [B, Tpast+T, Hkv, D]
            k, v = torch.cat([past[0], k], dim=1), torch.cat([past[1], v], dim=1)
        keep = min(self.window - 1, k.shape[1])  # later queries never look further back
        cache.layers[self.layer_idx] = (k[:, k.shape[1] - keep :], v[:, v.shape[1] - keep :])
        Tq, Tk = q.shape[1], k.shape[1]
        mask = local_causal_mask(Tq, Tk, self.window, q.device)[None, None]  # [1, 1, Tq, Tk]
        # left padding: the mask covers all past keys, the cache the last Tk
        if info.key_mask is not None:
            key_mask = info.key_mask[:, -Tk:]
            mask = mask & key_mask[:, None, None, :]
            mask = mask | ~key_mask[:, None, -Tq:, None]  # padded queries: avoid all-masked rows
        return sdpa(q, k, v, mask=mask, scale=scale)
