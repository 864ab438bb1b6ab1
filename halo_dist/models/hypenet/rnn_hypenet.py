"""HypeNet's RNN mixers: Lightning Attention (the distilled HypeNet's RNN layers) and the sweep
mixers (Gated DeltaNet, GLA, Mamba2, RWKV-7), all on the teacher attention's projections so its
weights transfer.
Kernels are in ops_rnn.py; under Ulysses sequence parallelism the same forward runs between
``sp_scatter`` and ``sp_gather`` (sequence_parallel_hypenet.py).

Exported with every checkpoint: torch and transformers only (fla optional, through ops_rnn).
"""

from __future__ import annotations

import math
from abc import ABCMeta, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_hypenet import HypeNetConfig
from .decode_lightning import LayerEnds, kernel_applies, lightning_decode_triton
from .layers_hypenet import (
    HypeNetRMSNorm,
    PackedLinears,
    SequenceInfo,
    apply_rope,
    linear_outputs,
    output_gate,
    output_linear,
    packed_for,
    rnn_output_rms_norm,
)
from .ops_rnn import (
    RWKV7_LOG_DECAY_MIN,
    gated_delta_attention,
    gla_attention,
    lightning_attention,
    lightning_log_decay,
    mamba2_attention,
    rwkv7_attention,
)
from .sequence_parallel_hypenet import SequenceParallelMixer

try:  # transformers >= 5: init functions that skip weights already loaded from a checkpoint
    from transformers import initialization as hf_init
except ImportError:  # pragma: no cover
    hf_init = nn.init


class RNNMixerBase(SequenceParallelMixer, nn.Module):
    """What every RNN mixer shares, shaped like the teacher's attention so its weights transfer:
    q/k/v/o of H heads x d_h, QK-norm (``rnn_qk_norm``), RoPE (``rnn_rope``), the per-head output
    RMSNorm's weight, the sigmoid output gate (``rnn_output_gate``), and k/v of H heads: cloned per
    head at conversion (``rnn_gqa_to_mha``) or kept as the teacher's GQA heads and repeated to H in
    ``project`` (so sequence parallelism splits q, k and v alike)."""

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

    def input_linears(self) -> list[nn.Linear]:
        """q, k, v (and the output gate's) projections, which all read the mixer's input."""
        gate = [self.g_proj] if self.config.rnn_output_gate else []
        return [self.q_proj, self.k_proj, self.v_proj, *gate]

    def project(self, x: torch.Tensor, info: SequenceInfo, packed: PackedLinears | None = None):
        """x ``[B, T, d]`` -> q, k, v ``[B, T, H, D]`` (k/v repeated to H heads if GQA is kept), and
        the output gate's logits ``[B, T, H*D]`` when ``packed`` computed them in the same GEMM
        (else None)."""
        B, T, _ = x.shape
        D, cfg = self.head_dim, self.config
        # q, k, v (+ the gate, computed here only in the packed GEMM)
        linears = self.input_linears()
        q, k, v, *g = linear_outputs(x, linears if packed is not None else linears[:3], packed)
        q = q.view(B, T, -1, D)  # [B, T, H*D] -> [B, T, H, D]
        k = k.view(B, T, -1, D)  # [B, T, Hkv*D] -> [B, T, Hkv, D]
        v = v.view(B, T, -1, D)
        if cfg.rnn_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.rnn_rope:
            cos, sin = info.rope(D, cfg.rope_theta, q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.num_kv_heads != self.num_heads:
            rep = self.num_heads // self.num_kv_heads
            # [B, T, Hkv, D] -> [B, T, H, D]
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        return q, k, v, (g[0] if g else None)


class LightningMixer(RNNMixerBase):
    """Lightning-Attention RNN layer, HyPE side "RoPE in RNN":
    q = RMSNorm(x W_q), k = RMSNorm(x W_k), v = x W_v; RoPE on q/k; S_t = γ_h S_{t-1} + k̃ᵀv;
    o = q̃ S / sqrt(d_h); y = (RMSNorm_per_head(o) ⊙ gate(x)) W_o."""

    def forward(self, x: torch.Tensor, info: SequenceInfo, cache=None):
        """x ``[B, T, d]`` -> ``[B, T, d]``; ``cache`` (decoding) holds the state ``[B, H, K, V]``.
        Under sequence parallelism T is this rank's T/sp tokens and the recurrence runs over all T
        tokens of H/sp heads."""
        in_place = getattr(cache, "lightning_in_place", False)
        if in_place and x.shape[1] == 1 and info.token_mask is None:
            # static decode: the state is updated in place in the cache's fixed buffer
            return output_linear(self.o_proj, self.decode_in_place(x, info, cache),
                                 packed_for(cache, self.layer_idx, "mixer"))
        # [B, T, H, D]
        q, k, v, g = self.project(x, info, packed_for(cache, self.layer_idx, "mixer"))
        info = self.sp_enter(info, cache)  # SP: the full sequence's layout
        q, k, v = self.sp_scatter(q, k, v)  # SP: [B, T/sp, H, D] -> [B, T, H/sp, D]
        # under SP the decays of this rank's heads
        log_decay = self.sp_local_heads(self.log_decay(x.device))  # [H(/sp)]
        B, T = q.shape[:2]
        state = None if cache is None else cache.layers[self.layer_idx]
        decode = state is not None and q.shape[1] <= 16
        # varlen kernels want the batch flattened: [B, T, h, D] -> [1, B*T, h, D]
        if info.cu_seqlens is not None:
            q, k, v = (t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v))
        o, final = lightning_attention(
            q, k, v, log_decay, self.scale, token_mask=info.token_mask, initial_state=state,
            cu_seqlens=info.cu_seqlens, chunk_size=self.config.lightning_chunk_size, decode=decode,
        )
        # [1, B*T, h, D] -> [B, T, h, D] (no-op without cu_seqlens)
        o = o.reshape(B, T, *o.shape[2:])
        if cache is not None:
            cache.set_state(self.layer_idx, final)
        return self.finish(self.sp_gather(o), x, g)  # SP: [B, T, H/sp, D] -> [B, T/sp, H, D]

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5  # == dividing k by sqrt(d_h)

    def log_decay(self, device) -> torch.Tensor:
        """log γ_h ``[H]``: a fixed function of H, not a parameter or buffer, so meta-device loading
        cannot leave it uninitialised."""
        return lightning_log_decay(self.num_heads, device=device, decay=self.config.lightning_decay)

    def finish(self, o: torch.Tensor, x: torch.Tensor,
               gate_logits: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm (per head by default), gate, W_o. o ``[B, T, H, D]`` -> ``[B, T, d]``."""
        return self.o_proj(self.gated_output(o, x, gate_logits))

    def gated_output(self, o: torch.Tensor, x: torch.Tensor,
                     gate_logits: torch.Tensor | None = None) -> torch.Tensor:
        """``finish`` before W_o: o ``[B, T, H, D]`` -> ``[B, T, H*D]``."""
        o = rnn_output_rms_norm(o.to(x.dtype), self.o_norm.weight, self.config)
        if self.config.rnn_output_gate:
            o = o * output_gate(x, self.g_proj, self.config.output_gate_scale, gate_logits)
        return o

    def decode_in_place(self, x: torch.Tensor, info: SequenceInfo, cache) -> torch.Tensor:
        """One token of a static decode step (``StaticDecodeCache``): x ``[B, 1, d]`` -> the output
        before W_o ``[B, 1, H*D]``, the state updated in place in the cache's buffer. Where the
        kernel runs (``decode_lightning.kernel_applies``) and the cache asks for it
        (``fuse_lightning``), one kernel does everything between the two GEMMs; otherwise
        ``project``, the update and ``gated_output``, which the kernel's tests compare it with."""
        packed = packed_for(cache, self.layer_idx, "mixer")
        # the cache's copy of the decays: computed here, they would be a kernel per layer and step
        log_decay = cache.lightning_log_decay
        if (getattr(cache, "fuse_lightning", False) and kernel_applies(x)
                and self.config.rnn_output_norm == "per_head"):
            B, D = x.shape[0], self.head_dim
            q, k, v, *g = linear_outputs(x, self.input_linears(), packed)
            # [B, 1, H*D] -> [B, 1, H, D] (k/v: Hkv heads; the kernel reads head h // (H / Hkv))
            q, k, v = (t.view(B, 1, -1, D) for t in (q, k, v))
            o = lightning_decode_triton(q, k, v, log_decay, self.scale,
                                        cache.layers[self.layer_idx],
                                        self.decode_ends(info, g, cache),
                                        getattr(cache, "deferred", {}).get(self.layer_idx))
            return o.view(B, 1, -1)  # [B, 1, H, D] -> [B, 1, H*D]
        q, k, v, g = self.project(x, info, packed)
        o = cache.lightning_step(self.layer_idx, q, k, v, log_decay, self.scale)
        return self.gated_output(o, x, g)

    def decode_ends(self, info: SequenceInfo, gate_logits: list, cache) -> LayerEnds:
        """The parts of ``decode_in_place`` the kernel fuses around the update (from the cache:
        the rotary inverse frequencies ``[D/2]``)."""
        cfg = self.config
        norm = cfg.rnn_qk_norm
        return LayerEnds(
            q_norm=self.q_norm.weight if norm else None,
            k_norm=self.k_norm.weight if norm else None,
            qk_eps=self.q_norm.eps if norm else 0.0,
            rope=(info.position_ids, cache.rope_inv_freq) if cfg.rnn_rope else None,
            o_norm=self.o_norm.weight, o_eps=cfg.rms_norm_eps,
            gate=gate_logits[0] if cfg.rnn_output_gate else None,
            gate_scale=cfg.output_gate_scale)


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
    """Mamba2's dt bias: softplus⁻¹ of dt spread log-uniformly over [dt_min, dt_max] across
    heads."""
    t = torch.linspace(0, 1, num_heads, dtype=torch.float64)
    dt = torch.exp(math.log(dt_min) + t * (math.log(dt_max) - math.log(dt_min)))
    return (dt + torch.log(-torch.expm1(-dt))).float()  # inverse softplus


class GatedRNNMixer(RNNMixerBase, metaclass=ABCMeta):
    """Skeleton of the sweep RNN mixers (GDN, GLA, RWKV-7, Mamba2) on :class:`RNNMixerBase`'s
    projections (the same as LightningMixer's, so the teacher's attention weights transfer). No
    short convolution, so the cache holds only the state.

    A subclass sets ``kernel`` (an ops_rnn dispatcher) and defines
    ``gates(x, q, k, v) -> (q, k, v, gates, extras)``: every gate a per-token, per-head tensor
    ``[B, T, H, ...]`` (token-local, so gates shard over sequence parallelism like q/k/v and no
    per-head parameter needs slicing); ``extras`` = (pre, post) token-local terms ``[B, T, H, V]``
    or None added to the recurrent output before / after the per-head norm (Mamba2's D skip,
    RWKV-7's bonus).
    Padding steps (``token_mask`` False) are identity steps: k, v and every gate are zeroed, and
    each subclass parametrises its gates so that 0 means "leave the state unchanged".
    """

    # an ops_rnn dispatcher: kernel(q, k, v, *gates, scale, initial_state, cu_seqlens, ...)
    kernel = None
    gate_names: tuple[str, ...] = ()

    # --- to override ---------------------------------------------------------------------------

    @abstractmethod
    def gates(self, x, q, k, v):
        """-> (q, k, v, {name: [B, T, H, ...]} in ``gate_names`` order, (pre, post))."""

    def init_mixer_parameters(self) -> None:
        """Deterministic init of the non-Linear parameters (called from ``_init_weights``)."""

    # --- shared --------------------------------------------------------------------------------

    def _kernel(self, q, k, v, gates, scale, cu_seqlens, initial_state=None, decode=False,
                need_state=False):
        """The recurrence on whole sequences. With ``cu_seqlens`` the batch is flattened for the
        varlen kernels: ``[B, T, H, *] -> [1, B*T, H, *]`` and back."""
        B, T = q.shape[:2]
        tensors = [q, k, v] + [gates[n] for n in self.gate_names]
        if cu_seqlens is not None:
            # [B, T, H, *] -> [1, B*T, H, *]
            tensors = [t.reshape(1, B * T, *t.shape[2:]) for t in tensors]
        o, final = type(self).kernel(
            *tensors, scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
            chunk_size=self.config.lightning_chunk_size, decode=decode,
            output_final_state=need_state,
        )
        return o.reshape(B, T, *o.shape[2:]), final  # [1, B*T, H, V] -> [B, T, H, V]

    def forward(self, x: torch.Tensor, info: SequenceInfo, cache=None):
        """x ``[B, T, d]`` -> ``[B, T, d]``; ``cache`` (decoding) holds the state. Under sequence
        parallelism the gates, per token and per head, travel with q/k/v (one all-to-all per dtype);
        ``pre``/``post`` stay on this rank's tokens, where ``finish`` adds them."""
        # [B, T, H, D]
        q, k, v, g = self.project(x, info, packed_for(cache, self.layer_idx, "mixer"))
        q, k, v, gates, (pre, post) = self.gates(x, q, k, v)
        info = self.sp_enter(info, cache)  # SP: the full sequence's layout
        names = list(self.gate_names)
        # SP: [B, T, H/sp, *]
        q, k, v, *gs = self.sp_scatter(q, k, v, *(gates[n] for n in names), packed=True)
        gates = dict(zip(names, gs))
        if info.token_mask is not None:  # pads: identity steps (see the class docstring)
            m = info.token_mask[:, :, None]  # [B, T, 1]
            k, v = k * m[..., None].to(k.dtype), v * m[..., None].to(v.dtype)
            gates = {n: g * (m if g.dim() == 3 else m[..., None]).to(g.dtype)
                     for n, g in gates.items()}
        state = None if cache is None else cache.layers[self.layer_idx]
        decode = state is not None and q.shape[1] <= 16
        scale = self.head_dim**-0.5
        o, final = self._kernel(q, k, v, gates, scale, info.cu_seqlens, state, decode,
                                need_state=cache is not None)
        if cache is not None:
            cache.set_state(self.layer_idx, final)
        # SP: [B, T, H/sp, V] -> [B, T/sp, H, V]
        return self.finish(self.sp_gather(o), x, pre, post, g)

    def finish(self, o: torch.Tensor, x: torch.Tensor, pre=None, post=None,
               gate_logits=None) -> torch.Tensor:
        """(+pre) RMSNorm (per head by default) (+post), gate, W_o. o ``[B, T, H, V]`` ->
        ``[B, T, d]``."""
        o = o.to(x.dtype)
        if pre is not None:
            o = o + pre.to(x.dtype)
        o = rnn_output_rms_norm(o, self.o_norm.weight, self.config)  # [B, T, H*V]
        if post is not None:
            o = o + post.to(x.dtype).flatten(2)  # [B, T, H, V] -> [B, T, H*V]
        if self.config.rnn_output_gate:
            o = o * output_gate(x, self.g_proj, self.config.output_gate_scale, gate_logits)
        return self.o_proj(o)


class GatedDeltaNetMixer(GatedRNNMixer):
    """Gated DeltaNet (Yang et al. 2024): S_t = α_t (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ, o = q
    S / √d_h, with q/k unit-normalised per head (after QK-norm and RoPE; the delta rule needs |k| =
    1), log α_t = -exp(A_log_h) softplus(x W_a + dt_bias_h), β_t = sigmoid(x W_b). fla's
    GatedDeltaNet without its short convolution."""

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
        q, k = (F.normalize(q.to(acc), dim=-1).to(q.dtype),
                F.normalize(k.to(acc), dim=-1).to(k.dtype))
        # [B, T, H]
        g = -self.A_log.to(acc).exp() * F.softplus(self.a_proj(x).to(acc) + self.dt_bias.to(acc))
        beta = torch.sigmoid(self.b_proj(x)).to(q.dtype)  # [B, T, H]
        return q, k, v, {"g": g, "beta": beta}, (None, None)


class GLAMixer(GatedRNNMixer):
    """Gated Linear Attention (Yang et al. 2023): S_t = diag(α_t) S_{t-1} + k_tᵀ v_t with
    per-channel log α_t = logsigmoid(x W_1 W_2 + b) / 16 (fla's low-rank gate, rank 16, normaliser
    16)."""

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
    """Mamba2 in multi-head SSD form (Dao & Gu 2024) with attention-shaped heads: C = q, B = k, x =
    v;
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
    S_t = S_{t-1} (diag(w_t) - κ̂_tᵀ (a_t ⊙ κ̂_t)) + v_tᵀ k̃_t, o = r S / √d_h (+ the bonus
    (r·(ρ⊙k̃)) v after the norm), with log w_t = -e^{-1/2} sigmoid(LoRA_w(x)), a_t =
    sigmoid(LoRA_a(x)), κ̂ = normalize(k ⊙ k_k), k̃ = k ⊙ (1 + (a - 1) ⊙ k_a). Token shift and the
    value residual (v_first) of the full RWKV-7 block are left out: both cross token/layer
    boundaries that the shared HypeNet layer interface does not carry."""

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
        w_logit = self.w_up(torch.tanh(self.w_down(x))).to(acc)  # [B, T, H*K]
        w = RWKV7_LOG_DECAY_MIN * torch.sigmoid(w_logit).view(shape)  # [B, T, H*K] -> [B, T, H, K]
        a = torch.sigmoid(self.a_up(self.a_down(x))).view(shape)  # [B, T, H*K] -> [B, T, H, K]
        # κ̂ per head (k_k [H*K] -> [H, K])
        kk = F.normalize((k * self.k_k.view(shape[2:])).to(acc), dim=-1).to(k.dtype)
        k = k * (1 + (a - 1) * self.k_a.view(shape[2:]))  # k_a [H*K] -> [H, K]
        # [B, T, H, 1]
        bonus = (q * k * self.r_k.to(q.dtype)).sum(-1, keepdim=True) * self.head_dim**-0.5
        return q, k, v, {"w": w, "a": -kk, "b": kk * a}, (None, bonus * v)
