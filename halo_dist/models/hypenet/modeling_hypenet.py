"""HypeNet: a hybrid of softmax-attention and Lightning-Attention RNN layers.

Self-contained (torch + transformers; fla / flash-attn optional) so an exported folder loads with
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` without halo_dist.

Block: ``H = X + Mixer(RMSNorm(X))``, ``X' = H + MLP(RMSNorm(H))``. The mixer of layer l is
``config.mixer_types[l]`` (a key of ``MIXER_CLASSES``).

Sequence parallelism: each mixer owns its Ulysses logic. A training engine injects an object
``mixer.sp`` with ``world_size``, ``rank``, ``seq_to_head(x)`` ``[B, T/sp, H, D] -> [B, T, H/sp, D]``
and ``head_to_seq(x)`` (the inverse); this file never imports the training code.
"""

from __future__ import annotations

import inspect
import math
from abc import ABCMeta, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.utils import ModelOutput

from .configuration_hypenet import HypeNetConfig
from .ops_hypenet import (
    RWKV7_LOG_DECAY_MIN,
    chunk_prefill_attention,
    gated_delta_attention,
    gla_attention,
    lightning_attention,
    lightning_log_decay,
    local_causal_mask,
    mamba2_attention,
    packed_causal_attention,
    rows_cu_seqlens,
    rwkv7_attention,
    sdpa,
)

try:  # transformers >= 5: init functions that skip weights already loaded from a checkpoint
    from transformers import initialization as hf_init
except ImportError:  # pragma: no cover
    hf_init = nn.init


# --------------------------------------------------------------------------------------------
# Small building blocks
# --------------------------------------------------------------------------------------------


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps)`` over the last dim, computed in fp32 and rounded once to x's dtype
    (Qwen3/Llama's RMSNorm before its weight; like transformers', float64 inputs are computed in fp32 too).
    ``F.rms_norm`` accumulates reduced precision in fp32 itself and is one fused kernel on CUDA instead of
    ~8 (casts included; a decode step runs ~130 norms); on CPU it reproduces the reference bit for bit
    (tests/test_hypenet.py)."""
    if x.dtype == torch.float64:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


class HypeNetRMSNorm(nn.Module):
    """RMSNorm in fp32, cast back before the weight (identical to Qwen3/Llama's)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalize(x, self.eps)


class HypeNetMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: HypeNetConfig):
        super().__init__()
        d, f, b = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(d, f, bias=b)
        self.up_proj = nn.Linear(d, f, bias=b)
        self.down_proj = nn.Linear(f, d, bias=b)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-convention rotary tables for per-document positions ``[B, T]`` -> cos/sin ``[B, T, 1, D]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=position_ids.device).float() / head_dim))
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, T, 1, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, T, H, D]`` rotated with the rotate-half convention of HF Llama/Qwen."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def logits_scale(position_ids: torch.Tensor, base: float) -> torch.Tensor:
    """s_t = ln(t + a) / ln(a) for per-document positions t ``[B, T]`` -> ``[B, T, 1, 1]`` fp32 (s_0 = 1)."""
    return (torch.log(position_ids.float() + base) / math.log(base))[..., None, None]


def output_gate(x: torch.Tensor, proj: nn.Linear, scale: float) -> torch.Tensor:
    """gate = scale * sigmoid(x W_z). With W_z = 0 and scale 2 it is exactly 1."""
    return scale * torch.sigmoid(proj(x))


def per_head_rms_norm(o: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over d_h of each head separately. o ``[B, T, H, D]``, weight ``[H*D]`` -> ``[B, T, H*D]``."""
    B, T, H, D = o.shape
    return weight * rms_normalize(o, eps).reshape(B, T, H * D)  # [B, T, H, D] -> [B, T, H*D]


def rnn_output_rms_norm(o: torch.Tensor, weight: torch.Tensor, config: HypeNetConfig) -> torch.Tensor:
    """The RNN output norm of ``config.rnn_output_norm``: per head, or over all H*d_h at once.
    o ``[B, T, H, D]``, weight ``[H*D]`` -> ``[B, T, H*D]``."""
    if config.rnn_output_norm == "all_heads":
        return weight * rms_normalize(o.flatten(2), config.rms_norm_eps)  # [B, T, H, D] -> [B, T, H*D]
    return per_head_rms_norm(o, weight, config.rms_norm_eps)


def kv_expand_factor(num_q_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """Smallest f dividing the GQA group size g with (num_kv_heads * f) % sp_size == 0.

    KV heads are replicated f times (``repeat_interleave``) so each SP rank holds the KV heads its
    local query heads use: expanded head e serves query heads with ``i // (g / f) == e``.
    """
    g = num_q_heads // num_kv_heads
    for f in range(1, g + 1):
        if g % f == 0 and (num_kv_heads * f) % sp_size == 0:
            return f
    raise ValueError(
        f"sequence parallel size {sp_size} cannot split {num_q_heads} query heads / {num_kv_heads} KV heads"
    )


# --------------------------------------------------------------------------------------------
# Per-forward sequence metadata and the cache
# --------------------------------------------------------------------------------------------


@dataclass
class SequenceInfo:
    """What every mixer needs to know about the token layout of one forward.

    position_ids  [B, T] position of each token inside its document (RoPE, logits scaling).
    cu_seqlens    int32 [S+1] document boundaries over the flattened B*T tokens (packed training);
                  None when each row is one sequence. With sequence parallelism these describe the
                  FULL sequence, while the local tensors hold T/sp tokens.
    token_mask    [B, T] bool, False at padding (generation with left padding).
    key_mask      [B, T_past + T] bool over the cached + new keys, for attention with a cache.
    """

    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    token_mask: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def rope(self, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[B, T, 1, D]`` of ``position_ids``, computed once per forward for every RoPE layer."""
        key = ("rope", head_dim, theta, dtype)
        if key not in self._memo:
            self._memo[key] = rope_cos_sin(self.position_ids, head_dim, theta, dtype)
        return self._memo[key]

    def prefill(self, config, dtype) -> "SequenceInfo":
        """Compute the tables the layers will ask for before they run. Layers compiled with ``model.compile=layer``
        then always see a filled memo: a lazily filled one is a different guard in the first layer than in the
        others, and in the activation-checkpointing recompute (a filled memo) than in the forward (an empty one),
        which torch.utils.checkpoint rejects. (A layer computing in another dtype, e.g. under autocast, still fills
        its own entry lazily.)"""
        kinds = set(config.mixer_types)
        if config.rnn_rope or "swa" in kinds or (config.attn_rope and "attention" in kinds):
            self.rope(config.head_dim, config.rope_theta, dtype)
        if config.attn_logits_scale_base is not None and "attention" in kinds:
            self.logits_scale(config.attn_logits_scale_base)
        return self

    def logits_scale(self, base: float) -> torch.Tensor:
        """s_t ``[B, T, 1, 1]`` fp32 of ``position_ids``, computed once per forward for every attention layer."""
        key = ("scale", base)
        if key not in self._memo:
            self._memo[key] = logits_scale(self.position_ids, base)
        return self._memo[key]


@dataclass
class HypeNetCausalLMOutput(ModelOutput):
    """Our own output class: transformers renamed ``past_key_values`` to ``cache`` between 5.17 and 5.24, and
    both attribute names work here. (Older generate looks the cache up in the output under ``past_key_values``,
    finds nothing and decodes on with the HypeNetCache it passed in, which the forward updated in place.)"""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: "HypeNetCache | None" = None
    hidden_states: tuple[torch.Tensor, ...] | None = None

    @property
    def past_key_values(self):
        return self.cache


# The name generate keeps the cache under (transformers 5.24 renamed ``past_key_values`` to ``cache``).
_GENERATE_CACHE_KWARG = ("cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
                         else "past_key_values")

# Extra KV slots a static (CUDA-graph) cache reserves: StaticDecoder's warm-up writes two tokens, then rewinds.
STATIC_WARMUP_TOKENS = 2


class HypeNetCache(Cache):
    """Per-layer decoding state: ``(k, v)`` ``[B, T, Hkv, D]`` for attention layers, the recurrent state
    ``[B, H, K, V]`` (fp32) for RNN layers, in ``layers[i]`` (None before the first forward).

    A ``transformers`` Cache, so ``generate`` drives it (beam search reorders it through ``reorder_cache``),
    but with its own layer storage: the mixers read and write ``layers`` directly, and the attention keys
    live in preallocated buffers (``append_kv``).

    ``static=True`` (``generate(..., cache_implementation="static")``): after the prefill, one-token steps
    run through ``StaticDecoder`` on this cache's buffers (a CUDA-graph replay per token on CUDA, the same
    step eagerly elsewhere); ``max_cache_len`` then bounds the tokens it can hold.
    """

    # A plain attribute, declared on the class so that it shadows transformers 5.17's read-only (deprecated)
    # ``Cache.max_cache_len`` property, which would refuse the assignment in __init__.
    max_cache_len: int | None = None

    def __init__(self, num_layers: int, reserve_tokens: int = 0, max_cache_len: int | None = None,
                 static: bool = False):
        super().__init__(layers=[None] * num_layers)
        self.seen_tokens = 0
        self.reserve_tokens = reserve_tokens  # room left after the prefill for decoded tokens
        self.max_cache_len = max_cache_len  # room for this many tokens in all, if more than prompt + reserve
        self.static = static
        self._kv_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._decoder = None  # the StaticDecoder that owns the buffers once static steps began

    def append_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k/v ``[B, T, Hkv, D]`` to layer ``layer_idx``; returns views of all cached keys/values.

        The keys live in a buffer with spare room (grown by doubling), so a decode step writes one
        token instead of copying the whole cache (torch.cat would move O(T) bytes per token: 60 GB per
        step for a 1.7B-shape teacher at 512K)."""
        past = self.layers[layer_idx]
        used = 0 if past is None else past[0].shape[1]
        new = used + k.shape[1]
        buf = self._kv_buffers.get(layer_idx)
        if buf is None or buf[0].shape[1] < new or buf[0].shape[0] != k.shape[0]:
            # prefill: the prompt plus the reserved decode room; beyond it, grow by doubling
            room = max(new + self.reserve_tokens, self.max_cache_len or 0) if past is None else max(new, 2 * used)
            grown = tuple(t.new_empty(t.shape[0], room, *t.shape[2:]) for t in (k, v))  # [B, room, Hkv, D]
            if past is not None:
                grown[0][:, :used].copy_(past[0])
                grown[1][:, :used].copy_(past[1])
            buf = self._kv_buffers[layer_idx] = grown
        buf[0][:, used:new].copy_(k)
        buf[1][:, used:new].copy_(v)
        self.layers[layer_idx] = (buf[0][:, :new], buf[1][:, :new])  # [B, T_past + T, Hkv, D] views
        return self.layers[layer_idx]

    def set_state(self, layer_idx: int, state: torch.Tensor) -> None:
        """The recurrent state ``[B, H, K, V]`` of RNN layer ``layer_idx`` after this forward."""
        self.layers[layer_idx] = state

    # --- static (CUDA-graph) decoding ------------------------------------------------------------------

    def static_step(self, model, tokens: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Next-token logits ``[B, V]`` for ``tokens`` ``[B, 1]`` through the StaticDecoder (built on the first
        step from the prefilled buffers; ``attention_mask`` covers the prompt's left padding). None once the
        buffers are full (e.g. generation continued past ``max_cache_len``): the caller steps dynamically."""
        if self._decoder is None:
            from .static_decode import StaticDecoder

            room = min((buf[0].shape[1] for buf in self._kv_buffers.values()), default=None)
            if room is not None and room - self.seen_tokens < 1 + STATIC_WARMUP_TOKENS:
                return None
            prompt_mask = None if attention_mask is None else attention_mask[:, : self.seen_tokens]
            self._decoder = StaticDecoder(model, self, attention_mask=prompt_mask)
        elif self._decoder.room_left is not None and self._decoder.room_left < 1:
            self.leave_static()
            return None
        logits = self._decoder.step(tokens).clone()  # the decoder's buffer is overwritten by the next step
        self.seen_tokens = self._decoder.length
        return logits

    def leave_static(self) -> None:
        """Hand the decoder's state back to ``layers`` (for a forward the static step cannot run, or a
        batch-size change); a later one-token step builds a new decoder."""
        dec = self._decoder
        if dec is None:
            return
        n = dec.length
        for i, entry in enumerate(dec.cache.layers):
            self.layers[i] = (entry[0][:, :n], entry[1][:, :n]) if isinstance(entry, tuple) else entry
        self.seen_tokens = n
        self._decoder = None

    # --- transformers' Cache interface ------------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """-1: the dynamic cache grows; a static one holds what its buffers were sized for."""
        return self.max_cache_len if self.static and self.max_cache_len else -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.seen_tokens > 0

    def reset(self) -> None:
        self.layers = [None] * len(self.layers)
        self._kv_buffers.clear()
        self._decoder = None
        self.seen_tokens = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep rows ``beam_idx`` (beam search: the beams each new beam continues; any selection of rows)."""
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        batch = self.batch_size
        if batch > 0:
            self._select_rows(torch.arange(batch).repeat_interleave(repeats))

    def _select_rows(self, idx: torch.Tensor) -> None:
        """Rows ``idx`` of every KV buffer and recurrent state. Under a static decoder with the batch size
        unchanged, in place (the CUDA graph reads fixed addresses); otherwise into new tensors, the KV
        buffers keeping their spare room."""
        if self._decoder is not None:
            if idx.numel() == self.batch_size:
                self._decoder.cache.select_rows_(idx)
                return
            self.leave_static()
        for i, entry in enumerate(self.layers):
            if entry is None:
                continue
            rows = idx.to(entry[0].device if isinstance(entry, tuple) else entry.device)
            if not isinstance(entry, tuple):
                self.layers[i] = entry.index_select(0, rows)
                continue
            buf = self._kv_buffers.get(i)
            if buf is not None and buf[0].shape[0] == entry[0].shape[0]:
                used = entry[0].shape[1]
                buf = self._kv_buffers[i] = tuple(b.index_select(0, rows) for b in buf)  # [B', room, Hkv, D]
                self.layers[i] = (buf[0][:, :used], buf[1][:, :used])
            else:  # a sliding-window layer's rolling cache (no buffer)
                self.layers[i] = tuple(t.index_select(0, rows) for t in entry)

    def crop(self, tokens_to_remove: int) -> None:
        """Only ``crop(0)``: a recurrent state cannot be rewound to an earlier token."""
        if tokens_to_remove:
            raise NotImplementedError("HypeNetCache cannot drop tokens: RNN states cannot be rewound")

    def activate_past_recording(self) -> None:
        """Nothing to record: the cache is not croppable, so generate never asks it to roll back."""

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        if self._decoder is not None:
            return self._decoder.tokens.shape[0]
        entry = next((e for e in self.layers if e is not None), None)
        if entry is None:
            return -1
        return (entry[0] if isinstance(entry, tuple) else entry).shape[0]

    @property
    def is_compileable(self) -> bool:
        """False: generate must not torch.compile the forward around this cache (static decoding captures its
        own graph)."""
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.seen_tokens > 0

    @property
    def is_sliding(self) -> list[bool]:
        """Sliding-window layers keep their last keys in plain tensors, not in a buffer."""
        return [isinstance(e, tuple) and i not in self._kv_buffers for i, e in enumerate(self.layers)]

    @property
    def is_linear(self) -> list[bool]:
        """Which layers hold a recurrent state (known after the first forward)."""
        return [isinstance(e, torch.Tensor) for e in self.layers]


# --------------------------------------------------------------------------------------------
# Mixers
# --------------------------------------------------------------------------------------------


class HypeNetAttention(nn.Module):
    """The teacher's GQA softmax attention, HyPE side: NoPE by default, QK-norm kept, logits scaling
    s_t applied to q before the kernel (so flash/SDPA still apply), optional sigmoid output gate."""

    def __init__(self, config: HypeNetConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        d, H, Hkv, D = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
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
        self.sp = None  # injected by the training engine for Ulysses sequence parallelism

    # q/k positional treatment, read from the config at forward time (calibrate-scaling changes the base)
    @property
    def rope(self) -> bool:
        return self.config.attn_rope

    @property
    def logits_scale_base(self) -> float | None:
        return self.config.attn_logits_scale_base

    def project(self, x: torch.Tensor, info: SequenceInfo):
        """x ``[B, T, d]`` -> q ``[B, T, H, D]``, k/v ``[B, T, Hkv, D]`` with norms, RoPE and scaling."""
        B, T, _ = x.shape
        D, cfg = self.head_dim, self.config
        q = self.q_proj(x).view(B, T, -1, D)  # [B, T, H*D] -> [B, T, H, D]
        k = self.k_proj(x).view(B, T, -1, D)
        v = self.v_proj(x).view(B, T, -1, D)
        if cfg.attn_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            cos, sin = info.rope(D, cfg.rope_theta, q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.logits_scale_base is not None:
            q = (q.float() * info.logits_scale(self.logits_scale_base)).to(v.dtype)
        return q, k, v

    def forward(self, x: torch.Tensor, info: SequenceInfo, cache: HypeNetCache | None = None):
        q, k, v = self.project(x, info)
        scale = self.head_dim**-0.5
        if cache is not None:
            o = self._attend_with_cache(q, k, v, info, cache, scale)
        elif self.sp is not None:
            o = self._attend_sequence_parallel(q, k, v, info, scale)
        else:
            o = self._attend(q, k, v, info, scale)
        return self.finish(o, x)

    def _attend(self, q, k, v, info: SequenceInfo, scale: float):
        if info.cu_seqlens is not None:
            return packed_causal_attention(q, k, v, info.cu_seqlens, info.max_seqlen, scale)
        if info.token_mask is not None:  # padded batch without cache: causal + key padding
            T = q.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
            mask = causal[None, None] & info.token_mask[:, None, None, :]  # [B, 1, T, T]
            mask = mask | ~info.token_mask[:, None, :, None]  # padded queries see everything (no NaN)
            return sdpa(q, k, v, mask=mask, scale=scale)
        return sdpa(q, k, v, is_causal=True, scale=scale)

    def _attend_with_cache(self, q, k, v, info: SequenceInfo, cache: HypeNetCache, scale: float):
        if getattr(cache, "is_static", False):  # StaticDecodeCache: fixed buffers, device-side position
            return cache.decode_attention(self.layer_idx, q, k, v, scale)
        past = cache.layers[self.layer_idx]
        k, v = cache.append_kv(self.layer_idx, k, v)  # [B, Tpast+T, Hkv, D]
        Tq, Tk = q.shape[1], k.shape[1]
        if info.key_mask is None:
            # no padding: prefill is plain causal attention (flash kernels, no [Tq, Tk] mask), a single
            # new query attends to every cached key, a prefill chunk is lower-right causal
            if past is None or Tq == 1:
                return sdpa(q, k, v, is_causal=past is None, scale=scale)
            return chunk_prefill_attention(q, k, v, scale)
        causal = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
        mask = causal[None, None]  # [1, 1, Tq, Tk]
        if info.key_mask is not None:
            mask = mask & info.key_mask[:, None, None, :]
            mask = mask | ~info.key_mask[:, None, -Tq:, None]  # padded queries: avoid all-masked rows
        return sdpa(q, k, v, mask=mask, scale=scale)

    def _attend_sequence_parallel(self, q, k, v, info: SequenceInfo, scale: float):
        """Ulysses: [B, T/sp, H, D] -> all-to-all -> [B, T, H/sp, D], this layer's full-sequence kernel
        (``_attend``: causal, or windowed for SlidingWindowAttention), back."""
        sp = self.sp
        if self.num_heads % sp.world_size:
            raise ValueError(f"sp_size={sp.world_size} does not divide num_attention_heads={self.num_heads}")
        f = kv_expand_factor(self.num_heads, self.num_kv_heads, sp.world_size)
        if f > 1:  # replicate KV heads so every rank holds the ones its query heads use
            k, v = k.repeat_interleave(f, dim=2), v.repeat_interleave(f, dim=2)  # [B, T/sp, Hkv*f, D]
        q, k, v = sp.seq_to_head(q), sp.seq_to_head(k), sp.seq_to_head(v)  # [B, T, heads/sp, D]
        full = SequenceInfo(position_ids=info.position_ids, cu_seqlens=info.cu_seqlens, max_seqlen=info.max_seqlen)
        return sp.head_to_seq(self._attend(q, k, v, full, scale))  # [B, T, H/sp, D] -> [B, T/sp, H, D]

    def finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Optional per-head norm and output gate, then W_o. o ``[B, T, H, D]`` -> ``[B, T, d]``."""
        B, T, H, D = o.shape
        if self.config.attn_output_norm:
            o = per_head_rms_norm(o, self.o_norm.weight, self.config.rms_norm_eps)
        else:
            o = o.reshape(B, T, H * D)  # [B, T, H, D] -> [B, T, H*D]
        if self.config.attn_output_gate:
            o = o * output_gate(x, self.g_proj, self.config.output_gate_scale)
        return self.o_proj(o)


class RNNMixerBase(nn.Module):
    """What every RNN mixer shares, shaped like the teacher's attention so its weights transfer: q/k/v/o
    of H heads x d_h, QK-norm (``rnn_qk_norm``), RoPE (``rnn_rope``), the per-head output RMSNorm's
    weight, the sigmoid output gate (``rnn_output_gate``), GQA k/v kept or cloned to H heads, and the
    ``.sp`` slot the engine fills for Ulysses sequence parallelism."""

    def __init__(self, config: HypeNetConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        d, H, D = config.hidden_size, config.num_attention_heads, config.head_dim
        self.num_heads, self.head_dim = H, D
        self.num_kv_heads = H if config.rnn_gqa_to_mha else config.num_key_value_heads
        self.q_proj = nn.Linear(d, H * D, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * D, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * D, bias=config.qkv_bias)
        self.o_proj = nn.Linear(H * D, d, bias=config.o_bias)
        if config.rnn_qk_norm:
            self.q_norm = HypeNetRMSNorm(D, config.rms_norm_eps)
            self.k_norm = HypeNetRMSNorm(D, config.rms_norm_eps)
        self.o_norm = HypeNetRMSNorm(H * D, config.rms_norm_eps)
        if config.rnn_output_gate:
            self.g_proj = nn.Linear(d, H * D, bias=False)
        self.sp = None

    def project(self, x: torch.Tensor, info: SequenceInfo):
        """x ``[B, T, d]`` -> q, k, v ``[B, T, H, D]`` (k/v repeated to H heads if GQA is kept)."""
        B, T, _ = x.shape
        D, cfg = self.head_dim, self.config
        q = self.q_proj(x).view(B, T, -1, D)  # [B, T, H*D] -> [B, T, H, D]
        k = self.k_proj(x).view(B, T, -1, D)
        v = self.v_proj(x).view(B, T, -1, D)
        if cfg.rnn_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.rnn_rope:
            cos, sin = info.rope(D, cfg.rope_theta, q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.num_kv_heads != self.num_heads:
            g = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)  # [B, T, Hkv, D] -> [B, T, H, D]
        return q, k, v


class LightningMixer(RNNMixerBase):
    """Lightning-Attention RNN layer, HyPE side "RoPE in RNN":
    q = RMSNorm(x W_q), k = RMSNorm(x W_k), v = x W_v; RoPE on q/k; S_t = γ_h S_{t-1} + k̃ᵀv;
    o = q̃ S / sqrt(d_h); y = (RMSNorm_per_head(o) ⊙ gate(x)) W_o."""

    def forward(self, x: torch.Tensor, info: SequenceInfo, cache: HypeNetCache | None = None):
        q, k, v = self.project(x, info)
        scale = self.head_dim**-0.5  # == dividing k by sqrt(d_h)
        # log γ_h is a fixed function of H (not a parameter or buffer, so meta-device loading cannot
        # leave it uninitialised)
        log_decay = lightning_log_decay(self.num_heads, device=x.device, decay=self.config.lightning_decay)
        if self.sp is not None:
            o = self._recur_sequence_parallel(q, k, v, info, log_decay, scale)
        else:
            state = None if cache is None else cache.layers[self.layer_idx]
            decode = cache is not None and state is not None and q.shape[1] <= 16
            B, T = q.shape[:2]
            if info.cu_seqlens is not None:  # varlen kernels want the batch flattened: [B, T, H, D] -> [1, B*T, H, D]
                q, k, v = (t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v))
            o, final = lightning_attention(
                q, k, v, log_decay, scale, token_mask=info.token_mask, initial_state=state,
                cu_seqlens=info.cu_seqlens, chunk_size=self.config.lightning_chunk_size, decode=decode,
            )
            o = o.reshape(B, T, *o.shape[2:])  # [1, B*T, H, D] -> [B, T, H, D] (no-op without cu_seqlens)
            if cache is not None:
                cache.set_state(self.layer_idx, final)
        return self.finish(o, x)

    def _recur_sequence_parallel(self, q, k, v, info: SequenceInfo, log_decay, scale):
        """Heads are independent, so head-parallel over the full sequence is exact."""
        sp = self.sp
        if self.num_heads % sp.world_size:
            raise ValueError(f"sp_size={sp.world_size} does not divide the {self.num_heads} Lightning heads")
        q, k, v = sp.seq_to_head(q), sp.seq_to_head(k), sp.seq_to_head(v)  # [B, T/sp, H, D] -> [B, T, H/sp, D]
        h = self.num_heads // sp.world_size
        local_decay = log_decay[sp.rank * h : (sp.rank + 1) * h]  # the decays of this rank's heads
        cu = info.cu_seqlens
        if cu is not None:  # varlen kernels want the batch flattened: [B, T, h, D] -> [1, B*T, h, D]
            B, T = q.shape[:2]
            q, k, v = (t.reshape(1, B * T, h, -1) for t in (q, k, v))
        o, _ = lightning_attention(q, k, v, local_decay, scale, cu_seqlens=cu, chunk_size=self.config.lightning_chunk_size)
        if cu is not None:
            o = o.reshape(B, T, h, -1)  # [1, B*T, h, D] -> [B, T, h, D]
        return sp.head_to_seq(o)  # [B, T, H/sp, D] -> [B, T/sp, H, D]

    def finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm (per head by default), gate, W_o. o ``[B, T, H, D]`` -> ``[B, T, d]``."""
        o = rnn_output_rms_norm(o.to(x.dtype), self.o_norm.weight, self.config)
        if self.config.rnn_output_gate:
            o = o * output_gate(x, self.g_proj, self.config.output_gate_scale)
        return self.o_proj(o)


# --------------------------------------------------------------------------------------------
# Sweep mixers: the other RNN mixers of the from-scratch sweeps
# --------------------------------------------------------------------------------------------


class SlidingWindowAttention(HypeNetAttention):
    """Softmax attention over the last ``config.sliding_window`` tokens of the query's document
    (SWAN-GPT's local layers): RoPE if ``config.swa_rope``, no logits scaling, the attention layer's
    QK-norm / output gate / output norm switches. The decode cache keeps only the last W - 1 keys."""

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
            return packed_causal_attention(q, k, v, info.cu_seqlens, info.max_seqlen, scale, self.window)
        if info.token_mask is not None:  # padded batch without cache: causal window + key padding
            mask = local_causal_mask(T, T, self.window, q.device)[None, None] & info.token_mask[:, None, None, :]
            mask = mask | ~info.token_mask[:, None, :, None]  # padded queries see everything (no NaN)
            return sdpa(q, k, v, mask=mask, scale=scale)  # mask [B, 1, T, T]
        if self.window >= T:
            return sdpa(q, k, v, is_causal=True, scale=scale)
        # each row is one document: the varlen kernels apply the window without a [T, T] mask
        return packed_causal_attention(q, k, v, rows_cu_seqlens(B, T, q.device), T, scale, self.window)

    def _attend_with_cache(self, q, k, v, info: SequenceInfo, cache: HypeNetCache, scale: float):
        past = cache.layers[self.layer_idx]
        if past is not None:
            k, v = torch.cat([past[0], k], dim=1), torch.cat([past[1], v], dim=1)  # [B, Tpast+T, Hkv, D]
        keep = min(self.window - 1, k.shape[1])  # later queries never look further back
        cache.layers[self.layer_idx] = (k[:, k.shape[1] - keep :], v[:, v.shape[1] - keep :])
        Tq, Tk = q.shape[1], k.shape[1]
        mask = local_causal_mask(Tq, Tk, self.window, q.device)[None, None]  # [1, 1, Tq, Tk]
        if info.key_mask is not None:  # left padding: the mask covers all past keys, the cache the last Tk
            key_mask = info.key_mask[:, -Tk:]
            mask = mask & key_mask[:, None, None, :]
            mask = mask | ~key_mask[:, None, -Tq:, None]  # padded queries: avoid all-masked rows
        return sdpa(q, k, v, mask=mask, scale=scale)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for gates (decays are cumulated), fp64 kept for the exactness tests."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _init_copy(param: nn.Parameter, value: torch.Tensor) -> None:
    """Deterministic init that (with transformers >= 5) skips weights loaded from a checkpoint."""
    if hasattr(hf_init, "copy_"):
        hf_init.copy_(param, value.to(param.dtype))
    else:  # pragma: no cover
        with torch.no_grad():
            param.copy_(value)


def _log_uniform_dt_bias(num_heads: int, dt_min: float = 1e-3, dt_max: float = 0.1) -> torch.Tensor:
    """Mamba2's dt bias: softplus⁻¹ of dt spread log-uniformly over [dt_min, dt_max] across heads."""
    t = torch.linspace(0, 1, num_heads, dtype=torch.float64)
    dt = torch.exp(math.log(dt_min) + t * (math.log(dt_max) - math.log(dt_min)))
    return (dt + torch.log(-torch.expm1(-dt))).float()  # inverse softplus


class GatedRNNMixer(RNNMixerBase, metaclass=ABCMeta):
    """Skeleton of the sweep RNN mixers (GDN, GLA, RWKV-7, Mamba2) on :class:`RNNMixerBase`'s projections
    (the same as LightningMixer's, so the teacher's attention weights transfer). No short convolution,
    so the cache holds only the state.

    A subclass sets ``kernel`` (an ops_hypenet dispatcher) and defines ``gates(x, q, k, v) -> (q, k, v,
    gates, extras)``: every gate a per-token, per-head tensor ``[B, T, H, ...]`` (token-local, so gates
    shard over sequence parallelism like q/k/v and no per-head parameter needs slicing); ``extras`` =
    (pre, post) token-local terms ``[B, T, H, V]`` or None added to the recurrent output before /
    after the per-head norm (Mamba2's D skip, RWKV-7's bonus).
    Padding steps (``token_mask`` False) are identity steps: k, v and every gate are zeroed, and each
    subclass parametrises its gates so that 0 means "leave the state unchanged".
    """

    kernel = None  # an ops_hypenet dispatcher: kernel(q, k, v, *gates, scale, initial_state, cu_seqlens, ...)
    gate_names: tuple[str, ...] = ()

    # --- to override ---------------------------------------------------------------------------

    @abstractmethod
    def gates(self, x, q, k, v):
        """-> (q, k, v, {name: [B, T, H, ...]} in ``gate_names`` order, (pre, post))."""

    def init_mixer_parameters(self) -> None:
        """Deterministic init of the non-Linear parameters (called from ``_init_weights``)."""

    # --- shared --------------------------------------------------------------------------------

    def _kernel(self, q, k, v, gates, scale, cu_seqlens, initial_state=None, decode=False, need_state=False):
        """The recurrence on whole sequences. With ``cu_seqlens`` the batch is flattened for the varlen
        kernels: ``[B, T, H, *] -> [1, B*T, H, *]`` and back."""
        B, T = q.shape[:2]
        tensors = [q, k, v] + [gates[n] for n in self.gate_names]
        if cu_seqlens is not None:
            tensors = [t.reshape(1, B * T, *t.shape[2:]) for t in tensors]  # [B, T, H, *] -> [1, B*T, H, *]
        o, final = type(self).kernel(
            *tensors, scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
            chunk_size=self.config.lightning_chunk_size, decode=decode, output_final_state=need_state,
        )
        return o.reshape(B, T, *o.shape[2:]), final  # [1, B*T, H, V] -> [B, T, H, V]

    def forward(self, x: torch.Tensor, info: SequenceInfo, cache: HypeNetCache | None = None):
        q, k, v = self.project(x, info)
        q, k, v, gates, (pre, post) = self.gates(x, q, k, v)
        scale = self.head_dim**-0.5
        if self.sp is not None:
            o = self._recur_sequence_parallel(q, k, v, gates, info, scale)
        else:
            if info.token_mask is not None:  # pads: identity steps (see the class docstring)
                m = info.token_mask[:, :, None]  # [B, T, 1]
                k, v = k * m[..., None].to(k.dtype), v * m[..., None].to(v.dtype)
                gates = {n: g * (m if g.dim() == 3 else m[..., None]).to(g.dtype) for n, g in gates.items()}
            state = None if cache is None else cache.layers[self.layer_idx]
            decode = state is not None and q.shape[1] <= 16
            o, final = self._kernel(q, k, v, gates, scale, info.cu_seqlens, state, decode, need_state=cache is not None)
            if cache is not None:
                cache.set_state(self.layer_idx, final)
        return self.finish(o, x, pre, post)

    def _recur_sequence_parallel(self, q, k, v, gates, info: SequenceInfo, scale):
        """Ulysses: heads are independent, so head-parallel over the full sequence is exact. All gates
        are per-token and per-head, so they travel with q/k/v (one all-to-all per dtype)."""
        sp = self.sp
        if self.num_heads % sp.world_size:
            raise ValueError(f"sp_size={sp.world_size} does not divide the {self.num_heads} "
                             f"{type(self).__name__} heads")
        names = list(self.gate_names)
        q, k, v, *gs = _seq_to_head_packed(sp, [q, k, v] + [gates[n] for n in names])  # [B, T, H/sp, *]
        o, _ = self._kernel(q, k, v, dict(zip(names, gs)), scale, info.cu_seqlens)
        return sp.head_to_seq(o)  # [B, T, H/sp, V] -> [B, T/sp, H, V]

    def finish(self, o: torch.Tensor, x: torch.Tensor, pre=None, post=None) -> torch.Tensor:
        """(+pre) RMSNorm (per head by default) (+post), gate, W_o. o ``[B, T, H, V]`` -> ``[B, T, d]``."""
        o = o.to(x.dtype)
        if pre is not None:
            o = o + pre.to(x.dtype)
        o = rnn_output_rms_norm(o, self.o_norm.weight, self.config)  # [B, T, H*V]
        if post is not None:
            o = o + post.to(x.dtype).flatten(2)  # [B, T, H, V] -> [B, T, H*V]
        if self.config.rnn_output_gate:
            o = o * output_gate(x, self.g_proj, self.config.output_gate_scale)
        return self.o_proj(o)


def _seq_to_head_packed(sp, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """All-to-all several ``[B, T/sp, H, *rest]`` tensors with one collective per dtype.

    Same-dtype tensors are concatenated on a flattened last dim ``[B, T/sp, H, sum(rest)]``, exchanged
    to ``[B, T, H/sp, sum(rest)]`` and split back into ``[B, T, H/sp, *rest]``."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        flat = [tensors[i].flatten(3) if tensors[i].dim() > 3 else tensors[i][..., None] for i in idx]  # [B, T/sp, H, n_i]
        moved = sp.seq_to_head(torch.cat(flat, dim=-1))  # [B, T/sp, H, n] -> [B, T, H/sp, n]
        for i, part in zip(idx, moved.split([f.shape[-1] for f in flat], dim=-1)):
            rest = tensors[i].shape[3:]
            out[i] = part.reshape(*part.shape[:3], *rest)  # [B, T, H/sp, n_i] -> [B, T, H/sp, *rest]
    return out


class GatedDeltaNetMixer(GatedRNNMixer):
    """Gated DeltaNet (Yang et al. 2024): S_t = α_t (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ, o = q S / √d_h,
    with q/k unit-normalised per head (after QK-norm and RoPE; the delta rule needs |k| = 1),
    log α_t = -exp(A_log_h) softplus(x W_a + dt_bias_h), β_t = sigmoid(x W_b). fla's GatedDeltaNet
    without its short convolution."""

    kernel = staticmethod(gated_delta_attention)
    gate_names = ("g", "beta")

    def __init__(self, config: HypeNetConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        d, H = config.hidden_size, config.num_attention_heads
        self.a_proj = nn.Linear(d, H, bias=False)
        self.b_proj = nn.Linear(d, H, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H))

    def init_mixer_parameters(self) -> None:
        H = self.num_heads
        _init_copy(self.A_log, torch.log(torch.linspace(1.0, 16.0, H)))  # fla: A ~ U(0, 16)
        _init_copy(self.dt_bias, _log_uniform_dt_bias(H))

    def gates(self, x, q, k, v):
        acc = _acc_dtype(x)
        q, k = F.normalize(q.to(acc), dim=-1).to(q.dtype), F.normalize(k.to(acc), dim=-1).to(k.dtype)
        g = -self.A_log.to(acc).exp() * F.softplus(self.a_proj(x).to(acc) + self.dt_bias.to(acc))  # [B, T, H]
        beta = torch.sigmoid(self.b_proj(x)).to(q.dtype)  # [B, T, H]
        return q, k, v, {"g": g, "beta": beta}, (None, None)


class GLAMixer(GatedRNNMixer):
    """Gated Linear Attention (Yang et al. 2023): S_t = diag(α_t) S_{t-1} + k_tᵀ v_t with per-channel
    log α_t = logsigmoid(x W_1 W_2 + b) / 16 (fla's low-rank gate, rank 16, normaliser 16)."""

    kernel = staticmethod(gla_attention)
    gate_names = ("gk",)
    gate_rank, gate_normalizer = 16, 16.0

    def __init__(self, config: HypeNetConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        d, H, D = config.hidden_size, config.num_attention_heads, config.head_dim
        self.gk_down = nn.Linear(d, self.gate_rank, bias=False)
        self.gk_up = nn.Linear(self.gate_rank, H * D, bias=True)

    def gates(self, x, q, k, v):
        acc = _acc_dtype(x)
        gk = F.logsigmoid(self.gk_up(self.gk_down(x)).to(acc)) / self.gate_normalizer
        return q, k, v, {"gk": gk.view(*q.shape)}, (None, None)  # gk [B, T, H*K] -> [B, T, H, K]


class Mamba2Mixer(GatedRNNMixer):
    """Mamba2 in multi-head SSD form (Dao & Gu 2024) with attention-shaped heads: C = q, B = k, x = v;
    S_t = exp(-exp(A_log_h) dt_t) S_{t-1} + k_t (dt_t v_t)ᵀ, dt_t = softplus(x W_dt + dt_bias_h),
    y = q S / √d_h + D_h v (the skip, before the output norm as in Mamba2)."""

    kernel = staticmethod(mamba2_attention)
    gate_names = ("g",)

    def __init__(self, config: HypeNetConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        H = config.num_attention_heads
        self.dt_proj = nn.Linear(config.hidden_size, H, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.D = nn.Parameter(torch.empty(H))

    def init_mixer_parameters(self) -> None:
        H = self.num_heads
        _init_copy(self.A_log, torch.log(torch.linspace(1.0, 16.0, H)))  # Mamba2: A ~ U(1, 16)
        _init_copy(self.dt_bias, _log_uniform_dt_bias(H))
        _init_copy(self.D, torch.ones(H))

    def gates(self, x, q, k, v):
        acc = _acc_dtype(x)
        dt = F.softplus(self.dt_proj(x).to(acc) + self.dt_bias.to(acc))  # [B, T, H]
        g = -self.A_log.to(acc).exp() * dt
        skip = v * self.D.to(v.dtype)[:, None]  # D_h x: [B, T, H, V] * [H, 1]
        return q, k, (v.to(acc) * dt[..., None]).to(v.dtype), {"g": g}, (skip, None)


class RWKV7Mixer(GatedRNNMixer):
    """RWKV-7 "Goose" time mixing (Peng et al. 2025) with attention-shaped heads (r = q):
    S_t = S_{t-1} (diag(w_t) - κ̂_tᵀ (a_t ⊙ κ̂_t)) + v_tᵀ k̃_t, o = r S / √d_h (+ the bonus (r·(ρ⊙k̃)) v
    after the norm), with log w_t = -e^{-1/2} sigmoid(LoRA_w(x)), a_t = sigmoid(LoRA_a(x)),
    κ̂ = normalize(k ⊙ k_k), k̃ = k ⊙ (1 + (a - 1) ⊙ k_a). Token shift and the value residual
    (v_first) of the full RWKV-7 block are left out: both cross token/layer boundaries that the
    shared HypeNet layer interface does not carry."""

    kernel = staticmethod(rwkv7_attention)
    gate_names = ("w", "a", "b")
    lora_rank = 64

    def __init__(self, config: HypeNetConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        d, H, D = config.hidden_size, config.num_attention_heads, config.head_dim
        r = min(self.lora_rank, d)
        self.w_down, self.w_up = nn.Linear(d, r, bias=False), nn.Linear(r, H * D, bias=True)
        self.a_down, self.a_up = nn.Linear(d, r, bias=False), nn.Linear(r, H * D, bias=True)
        self.k_k = nn.Parameter(torch.empty(H * D))
        self.k_a = nn.Parameter(torch.empty(H * D))
        self.r_k = nn.Parameter(torch.empty(H, D))

    def init_mixer_parameters(self) -> None:
        HD = self.num_heads * self.head_dim
        _init_copy(self.k_k, torch.full((HD,), 0.85))
        _init_copy(self.k_a, torch.ones(HD))
        _init_copy(self.r_k, torch.zeros(self.num_heads, self.head_dim))  # the bonus starts off

    def gates(self, x, q, k, v):
        acc = _acc_dtype(x)
        shape = q.shape  # [B, T, H, K]
        w = RWKV7_LOG_DECAY_MIN * torch.sigmoid(self.w_up(torch.tanh(self.w_down(x))).to(acc)).view(shape)
        a = torch.sigmoid(self.a_up(self.a_down(x))).view(shape)
        kk = F.normalize((k * self.k_k.view(shape[2:])).to(acc), dim=-1).to(k.dtype)  # κ̂ per head
        k = k * (1 + (a - 1) * self.k_a.view(shape[2:]))
        bonus = (q * k * self.r_k.to(q.dtype)).sum(-1, keepdim=True) * self.head_dim**-0.5  # [B, T, H, 1]
        return q, k, v, {"w": w, "a": -kk, "b": kk * a}, (None, bonus * v)


# Every name of configuration_hypenet.IMPLEMENTED_MIXERS (same constructor and forward).
MIXER_CLASSES: dict[str, type[nn.Module]] = {
    "attention": HypeNetAttention,
    "lightning": LightningMixer,
    "gdn": GatedDeltaNetMixer,
    "gla": GLAMixer,
    "rwkv7": RWKV7Mixer,
    "mamba2": Mamba2Mixer,
    "swa": SlidingWindowAttention,
}


# --------------------------------------------------------------------------------------------
# Blocks and models
# --------------------------------------------------------------------------------------------


class HypeNetDecoderLayer(nn.Module):
    def __init__(self, config: HypeNetConfig, layer_idx: int):
        super().__init__()
        self.mixer_type = config.mixer_types[layer_idx]
        self.input_layernorm = HypeNetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer = MIXER_CLASSES[self.mixer_type](config, layer_idx)
        self.post_attention_layernorm = HypeNetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = HypeNetMLP(config)

    def forward(self, x: torch.Tensor, info: SequenceInfo, cache: HypeNetCache | None = None) -> torch.Tensor:
        h = x + self.mixer(self.input_layernorm(x), info, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def compile_decoder_layers(model: nn.Module, scope: str) -> nn.Module:
    """Training speed: ``torch.compile`` every decoder layer in place (``scope="layer"``) or only its
    norm + SwiGLU MLP (``"mlp"``); ``"none"`` leaves the model eager. Inductor fuses the elementwise work
    (norms, RoPE, gates, residual adds, SiLU-mul) around the matmuls; fla kernels and the all-to-alls stay
    as they are (graph breaks). Parameters are untouched, so checkpoints and DeepSpeed see the same model."""
    if scope == "none":
        return model
    if scope not in ("mlp", "layer"):
        raise ValueError(f"compile scope must be none, mlp or layer, got {scope!r}")
    for layer in model.model.layers:
        if scope == "layer":
            layer.compile()
        else:
            layer.post_attention_layernorm.compile()
            layer.mlp.compile()
    return model


class HypeNetPreTrainedModel(PreTrainedModel):
    config_class = HypeNetConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["HypeNetDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            hf_init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                hf_init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            hf_init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, HypeNetRMSNorm):
            hf_init.ones_(module.weight)
        if isinstance(module, (HypeNetAttention, LightningMixer, GatedRNNMixer)) and hasattr(module, "g_proj"):
            hf_init.zeros_(module.g_proj.weight)  # gate starts at exactly 1 (see output_gate)
        if isinstance(module, GatedRNNMixer):
            module.init_mixer_parameters()


def sequence_info(
    input_shape: tuple[int, int],
    device: torch.device,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int | None,
    past_length: int,
) -> SequenceInfo:
    """Build the layout metadata once per forward.

    Packed training: ``cu_seqlens`` given, or ``position_ids`` that restart at 0 inside a row (the
    HF convention for packed batches), from which boundaries are derived.
    Padded batches: a 2D ``attention_mask`` over past + new tokens; positions count real tokens.
    """
    B, T = input_shape
    if cu_seqlens is not None:
        if position_ids is None:
            raise ValueError("cu_seqlens needs per-document position_ids")
        return SequenceInfo(position_ids, cu_seqlens.to(torch.int32), max_seqlen or T)
    if attention_mask is not None and not bool(attention_mask.all()):
        mask = attention_mask.bool()
        if position_ids is None:
            position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
        key_mask = mask if mask.shape[1] == past_length + T else None
        return SequenceInfo(position_ids, token_mask=mask[:, -T:], key_mask=key_mask)
    if position_ids is None:
        position_ids = torch.arange(past_length, past_length + T, device=device)[None].expand(B, T)
    elif past_length == 0 and T > 1 and bool((position_ids[:, 1:] == 0).any()):
        cu, max_len = cu_seqlens_from_position_ids(position_ids)
        return SequenceInfo(position_ids, cu, max_len)
    return SequenceInfo(position_ids)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Boundaries over the flattened ``[B, T]`` tokens where positions restart (and at row starts)."""
    B, T = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True
    idx = starts.flatten().nonzero().flatten()
    cu = torch.cat([idx, idx.new_tensor([B * T])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


class HypeNetModel(HypeNetPreTrainedModel):
    def __init__(self, config: HypeNetConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(HypeNetDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = HypeNetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        cache: HypeNetCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool = False,
    ):
        """Returns ``(final hidden [B, T, d] after the norm, per-layer hidden states or None)``."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        past = cache.seen_tokens if cache is not None else 0
        info = sequence_info(x.shape[:2], x.device, position_ids, attention_mask, cu_seqlens, max_seqlen, past)
        info.prefill(self.config, x.dtype)
        hidden = [x] if output_hidden_states else None
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and cache is None:
                x = torch.utils.checkpoint.checkpoint(layer, x, info, None, use_reentrant=False)
            else:
                x = layer(x, info, cache)
            if hidden is not None:
                hidden.append(x)
        if cache is not None:
            cache.seen_tokens += x.shape[1]
        return self.norm(x), hidden

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None):
        self.gradient_checkpointing = enable


class HypeNetForCausalLM(HypeNetPreTrainedModel, GenerationMixin):
    """HypeNet with an LM head. ``generate`` is transformers' (every GenerationConfig option, beam search,
    streamers, ...) over a :class:`HypeNetCache`; ``cache_implementation="static"`` decodes through
    ``StaticDecoder`` (CUDA graphs on CUDA)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _is_stateful = True  # RNN states cannot be rewound: no assisted decoding

    def __init__(self, config: HypeNetConfig):
        super().__init__(config)
        self.model = HypeNetModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        cache: HypeNetCache | None = None,
        past_key_values: HypeNetCache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        return_hidden_only: bool = False,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        """Causal LM forward.

        ``return_hidden_only=True`` returns the final normed hidden states ``[B, T, d]`` and skips the
        LM head, so distillation losses can fuse the vocabulary projection (never ``[T, V]`` logits).
        ``labels`` gives the usual shifted CE (for lm-eval / quick checks; training uses fused losses).
        ``return_dict`` (default ``config.return_dict``): a :class:`HypeNetCausalLMOutput`, else its tuple.
        """
        if output_attentions:
            raise ValueError("HypeNet does not return attention weights (its kernels never form them)")
        cache = cache if cache is not None else past_key_values
        if use_cache and cache is None:
            cache = HypeNetCache(self.config.num_hidden_layers)
        all_hidden = logits = None
        static = isinstance(cache, HypeNetCache) and cache.static
        if (static and cache.seen_tokens and input_ids is not None and input_ids.shape[1] == 1 and inputs_embeds is None
                and cu_seqlens is None and labels is None and not return_hidden_only and not output_hidden_states):
            logits = cache.static_step(self, input_ids, attention_mask)  # [B, V], or None: a dynamic step
        if logits is not None:
            logits = logits[:, None]  # [B, V] -> [B, 1, V]
        else:
            if static:
                cache.leave_static()
            hidden, all_hidden = self.model(
                input_ids, attention_mask, position_ids, cu_seqlens, max_seqlen, cache, inputs_embeds,
                bool(output_hidden_states),
            )
            if return_hidden_only:
                return hidden
            logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        out = HypeNetCausalLMOutput(
            loss=loss, logits=logits, cache=cache if use_cache else None,
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
        )
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        return out if return_dict else out.to_tuple()

    # --- generation: transformers' GenerationMixin over HypeNetCache ------------------------------------

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        """The cache ``generate`` decodes with: a :class:`HypeNetCache` sized for ``max_length`` tokens
        (attention keys preallocated). ``cache_implementation``: None / "dynamic", or "static" for the
        StaticDecoder (CUDA-graph) steps; a cache passed by the caller must be a HypeNetCache."""
        key = _GENERATE_CACHE_KWARG
        impl = generation_config.cache_implementation
        given = model_kwargs.get(key)
        if given is not None:
            if not isinstance(given, HypeNetCache):
                raise TypeError(f"HypeNet decodes with a HypeNetCache, not {type(given).__name__}")
            if impl is not None:
                raise ValueError("pass either a cache or cache_implementation, not both")
            given._is_user_defined = True  # generate returns a cache the caller passed in
            return
        if generation_config.use_cache is False:
            return
        if impl not in (None, "dynamic", "static"):
            raise ValueError(f"cache_implementation={impl!r}: HypeNet decodes with its own cache, "
                             "None/'dynamic', or 'static' for CUDA-graph steps (StaticDecoder)")
        static = impl == "static"
        if static and "swa" in self.config.mixer_types:
            raise ValueError("cache_implementation='static' does not support sliding-window layers (their cache "
                             "rolls); use the dynamic cache")
        tokens = generation_config.max_length
        if static:
            tokens = max(tokens, generation_config.max_cache_len or 0) + STATIC_WARMUP_TOKENS
        model_kwargs[key] = HypeNetCache(self.config.num_hidden_layers, max_cache_len=tokens, static=static)

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, attention_mask=None, **kwargs):
        """transformers' preparation, which slices off the tokens a restarted cache holds only when some layer
        keeps keys: here the cache counts its tokens for RNN-only models too. The cache travels in ``kwargs``
        under the installed transformers' name (``_GENERATE_CACHE_KWARG``)."""
        cache = kwargs.get(_GENERATE_CACHE_KWARG)
        seen = cache.get_seq_length() if isinstance(cache, HypeNetCache) else 0
        if (next_sequence_length is None and seen and input_ids.shape[1] > seen and kwargs.get("inputs_embeds") is None
                and (attention_mask is None or attention_mask.shape[1] == input_ids.shape[1])):
            next_sequence_length = input_ids.shape[1] - seen
        return super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, attention_mask=attention_mask, **kwargs)

    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, *args, **kwargs):
        """transformers' ``generate``, after checking the padding side: left padding is exact (pad keys are
        masked in attention, pad tokens are identity steps in the RNNs, positions count real tokens), so each
        row of a batch generates what it would alone; right padding would decode from a pad."""
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2 and bool((mask[:, :-1].bool() & ~mask[:, 1:].bool()).any()):
            raise ValueError("generate() needs left padding (a 0 in attention_mask after a 1 found)")
        if _GENERATE_CACHE_KWARG != "cache" and kwargs.get("cache") is not None:
            # transformers before the rename only knows past_key_values=: a cache passed as cache= (the newer
            # spelling) would otherwise reach the forward beside a fresh one that generate made
            if kwargs.get(_GENERATE_CACHE_KWARG) is not None:
                raise ValueError("pass the cache as cache= or past_key_values=, not both")
            kwargs[_GENERATE_CACHE_KWARG] = kwargs.pop("cache")
        return super().generate(inputs, generation_config, *args, **kwargs)
