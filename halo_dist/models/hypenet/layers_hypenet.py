"""Building blocks shared by HypeNet's mixers and model: RMSNorm, the SwiGLU MLP, RoPE, logits
scaling, output gates and norms, and ``SequenceInfo``, the token layout of one forward.

Exported with every checkpoint: torch only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_hypenet import HypeNetConfig
from .decode_gemv import decode_linear


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps)`` over the last dim, computed in fp32 and rounded once to x's
    dtype (Qwen3/Llama's RMSNorm before its weight; like transformers', float64 inputs are computed
    in fp32 too).
    ``F.rms_norm`` accumulates reduced precision in fp32 itself and is one fused kernel on CUDA
    instead of ~8 (casts included; a decode step runs ~130 norms); on CPU it reproduces the
    reference bit for bit (tests/test_hypenet.py)."""
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


class PackedLinears:
    """Linears that read the same input, as one GEMM: their weights (and biases) concatenated along
    the output dim, the result split back; and optionally the block's output linear (W_o, the MLP's
    down projection), which reads what the block computes from them. Decoding uses it
    (``StaticDecoder``): at batch 1 a step reads every weight once either way, but a lone 2048 x
    2048 GEMV keeps only a fraction of a GPU's SMs busy, and one launch replaces three or four.
    ``gemv``: every product through ``decode_gemv.decode_linear`` (the GEMV kernel where it beat
    cuBLAS for that shape), else cuBLAS. The concatenation is a copy: it does not follow later
    updates of the weights."""

    def __init__(self, linears: list[nn.Linear], output: nn.Linear | None = None,
                 gemv: bool = False):
        weights = [lin.weight.detach() for lin in linears]
        self.sizes = [w.shape[0] for w in weights]
        self.weight = torch.cat(weights)  # [sum N_i, d]
        if all(lin.bias is None for lin in linears):
            self.bias = None
        else:
            self.bias = torch.cat([lin.bias.detach() if lin.bias is not None
                                   else w.new_zeros(w.shape[0])
                                   for lin, w in zip(linears, weights)])
        self.out = output
        self.gemv = gemv

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        return decode_linear(x, weight, bias) if self.gemv else F.linear(x, weight, bias)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x ``[..., d]`` -> one ``[..., N_i]`` output per linear."""
        return self.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)

    def weights(self) -> list[torch.Tensor]:
        """The weights this pack multiplies by (for ``decode_gemv.tune_gemv``)."""
        return [self.weight] + ([self.out.weight] if self.out is not None else [])


def linear_outputs(x: torch.Tensor, linears: list[nn.Linear], packed: PackedLinears | None):
    """The outputs of ``linears`` on the shared input x: one GEMM through ``packed`` if given, else
    one each."""
    return packed(x) if packed is not None else tuple(lin(x) for lin in linears)


def output_linear(linear: nn.Linear, x: torch.Tensor, packed: PackedLinears | None):
    """A block's output linear on x: through ``packed`` when it carries it (decoding), else the
    module."""
    if packed is None or packed.out is not linear:
        return linear(x)
    return packed.linear(x, linear.weight, linear.bias)


def packed_for(cache, layer_idx: int, block: str) -> PackedLinears | None:
    """The packed input projections a StaticDecodeCache holds for ``block`` ("mixer" or "mlp") of
    layer ``layer_idx``; None for any other cache, or when the decoder packs none."""
    packs = getattr(cache, "packed", None)
    return None if packs is None else packs.get((layer_idx, block))


class HypeNetMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: HypeNetConfig):
        super().__init__()
        d, f, b = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(d, f, bias=b)
        self.up_proj = nn.Linear(d, f, bias=b)
        self.down_proj = nn.Linear(f, d, bias=b)

    def input_linears(self) -> list[nn.Linear]:
        """The linears reading the block's input (``PackedLinears`` packs them for decoding)."""
        return [self.gate_proj, self.up_proj]

    def forward(self, x, packed: PackedLinears | None = None):
        gate, up = linear_outputs(x, self.input_linears(), packed)
        return output_linear(self.down_proj, F.silu(gate) * up, packed)


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """HF's rotary inverse frequencies ``[D/2]`` fp32: theta^(-2i/D)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                         device=device).float() / head_dim))


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float,
                 dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-convention rotary tables for per-document positions ``[B, T]`` -> cos/sin
    ``[B, T, 1, D]``."""
    inv_freq = rope_inv_freq(head_dim, theta, position_ids.device)
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, T, 1, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, T, H, D]`` rotated with the rotate-half convention of HF Llama/Qwen."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def logits_scale(position_ids: torch.Tensor, base: float) -> torch.Tensor:
    """s_t = ln(t + a) / ln(a) for per-document positions t ``[B, T]`` -> ``[B, T, 1, 1]`` fp32 (s_0
    = 1)."""
    return (torch.log(position_ids.float() + base) / math.log(base))[..., None, None]


def output_gate(x: torch.Tensor, proj: nn.Linear, scale: float,
                logits: torch.Tensor | None = None) -> torch.Tensor:
    """gate = scale * sigmoid(x W_z) (``logits``: x W_z computed already). With W_z = 0 and scale 2
    it is exactly 1."""
    return scale * torch.sigmoid(proj(x) if logits is None else logits)


def per_head_rms_norm(o: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over d_h of each head separately. o ``[B, T, H, D]``, weight ``[H*D]`` ->
    ``[B, T, H*D]``."""
    B, T, H, D = o.shape
    return weight * rms_normalize(o, eps).reshape(B, T, H * D)  # [B, T, H, D] -> [B, T, H*D]


def rnn_output_rms_norm(o: torch.Tensor, weight: torch.Tensor,
                        config: HypeNetConfig) -> torch.Tensor:
    """The RNN output norm of ``config.rnn_output_norm``: per head, or over all H*d_h at once.
    o ``[B, T, H, D]``, weight ``[H*D]`` -> ``[B, T, H*D]``."""
    if config.rnn_output_norm == "all_heads":
        # [B, T, H, D] -> [B, T, H*D]
        return weight * rms_normalize(o.flatten(2), config.rms_norm_eps)
    return per_head_rms_norm(o, weight, config.rms_norm_eps)


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
        """cos/sin ``[B, T, 1, D]`` of ``position_ids``, computed once per forward for every RoPE
        layer."""
        key = ("rope", head_dim, theta, dtype)
        if key not in self._memo:
            self._memo[key] = rope_cos_sin(self.position_ids, head_dim, theta, dtype)
        return self._memo[key]

    def prefill(self, config, dtype) -> "SequenceInfo":
        """Compute the tables the layers will ask for before they run. Layers compiled with
        ``model.compile=layer`` then always see a filled memo: a lazily filled one is a different
        guard in the first layer than in the others, and in the activation-checkpointing recompute
        (a filled memo) than in the forward (an empty one), which torch.utils.checkpoint rejects. (A
        layer computing in another dtype, e.g. under autocast, still fills its own entry lazily.)"""
        kinds = set(config.mixer_types)
        if config.rnn_rope or "swa" in kinds or (config.attn_rope and "attention" in kinds):
            self.rope(config.head_dim, config.rope_theta, dtype)
        if config.attn_logits_scale_base is not None and "attention" in kinds:
            self.logits_scale(config.attn_logits_scale_base)
        return self

    def logits_scale(self, base: float) -> torch.Tensor:
        """s_t ``[B, T, 1, 1]`` fp32 of ``position_ids``, computed once per forward for every
        attention layer."""
        key = ("scale", base)
        if key not in self._memo:
            self._memo[key] = logits_scale(self.position_ids, base)
        return self._memo[key]

    def full_sequence(self) -> "SequenceInfo":
        """The layout a mixer's kernel sees under sequence parallelism, after the all-to-all gave it
        every token of its heads: the full sequence's ``cu_seqlens`` / ``max_seqlen`` (already
        global), no padding masks (SP batches are packed, never padded) and a fresh memo (the
        kernels read no positions: RoPE and logits scaling were applied to the local tokens before
        the exchange)."""
        return SequenceInfo(position_ids=self.position_ids, cu_seqlens=self.cu_seqlens,
                            max_seqlen=self.max_seqlen)


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
    """Boundaries over the flattened ``[B, T]`` tokens where positions restart (and at row
    starts)."""
    B, T = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True
    idx = starts.flatten().nonzero().flatten()
    cu = torch.cat([idx, idx.new_tensor([B * T])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())
