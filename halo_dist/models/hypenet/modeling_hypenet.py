"""HypeNet: a hybrid of softmax-attention and RNN layers, as Hugging Face classes.

Block: ``H = X + Mixer(RMSNorm(X))``, ``X' = H + MLP(RMSNorm(H))``. The mixer of layer l is
``config.mixer_types[l]`` (a key of ``MIXER_CLASSES``): attention_hypenet.py holds the
softmax-attention mixers, rnn_hypenet.py the RNN mixers. This file has the decoder layer, the model
and the causal-LM head; cache_hypenet.py the decoding cache and generation_hypenet.py what
``generate`` needs beyond transformers'.

Every ``.py`` of this package but ``__init__.py`` is exported verbatim with each checkpoint (torch
and transformers only, fla / flash-attn / Triton optional, relative imports among themselves), so an
exported folder loads with ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``
without halo_dist.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from .attention_hypenet import HypeNetAttention, SlidingWindowAttention
from .cache_hypenet import HypeNetCache
from .configuration_hypenet import HypeNetConfig
from .generation_hypenet import HypeNetGenerationMixin
from .layers_hypenet import HypeNetMLP, HypeNetRMSNorm, SequenceInfo, packed_for, sequence_info
from .rnn_hypenet import (GatedDeltaNetMixer, GatedRNNMixer, GLAMixer, LightningMixer, Mamba2Mixer,
                          RWKV7Mixer)

try:  # transformers >= 5: init functions that skip weights already loaded from a checkpoint
    from transformers import initialization as hf_init
except ImportError:  # pragma: no cover
    hf_init = nn.init


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


class HypeNetDecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + mixer(norm(x))``, ``h + mlp(norm(h))``."""

    def __init__(self, config: HypeNetConfig, layer_idx: int):
        super().__init__()
        self.mixer_type = config.mixer_types[layer_idx]
        self.input_layernorm = HypeNetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer = MIXER_CLASSES[self.mixer_type](config, layer_idx)
        self.post_attention_layernorm = HypeNetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = HypeNetMLP(config)

    def forward(self, x: torch.Tensor, info: SequenceInfo,
                cache: HypeNetCache | None = None) -> torch.Tensor:
        h = x + self.mixer(self.input_layernorm(x), info, cache)
        return h + self.mlp(self.post_attention_layernorm(h),
                            packed_for(cache, self.mixer.layer_idx, "mlp"))


def compile_decoder_layers(model: nn.Module, scope: str) -> nn.Module:
    """Training speed: ``torch.compile`` every decoder layer in place (``scope="layer"``) or only
    its norm + SwiGLU MLP (``"mlp"``); ``"none"`` leaves the model eager. Inductor fuses the
    elementwise work (norms, RoPE, gates, residual adds, SiLU-mul) around the matmuls; fla kernels
    and the all-to-alls stay as they are (graph breaks). Parameters are untouched, so checkpoints
    and DeepSpeed see the same model."""
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


@contextmanager
def eager_decoder_layers(model: nn.Module):
    """Within the block, decoder layers that ``compile_decoder_layers`` compiled run eagerly.
    Generation wants that: a prefill or decode step through a layer compiled for training shapes
    would compile it again for every new shape and cache layout, and the static decoder compiles
    its whole step itself (``StaticDecoder(compile=True)``). ``nn.Module.compile`` keeps the
    compiled call in ``_compiled_call_impl``, which is set aside here and restored after."""
    layers = list(model.model.layers)
    saved = [layer._compiled_call_impl for layer in layers]
    try:
        for layer in layers:
            layer._compiled_call_impl = None
        yield model
    finally:
        for layer, impl in zip(layers, saved):
            layer._compiled_call_impl = impl


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
        if (isinstance(module, (HypeNetAttention, LightningMixer, GatedRNNMixer))
                and hasattr(module, "g_proj")):
            hf_init.zeros_(module.g_proj.weight)  # gate starts at exactly 1 (see output_gate)
        if isinstance(module, GatedRNNMixer):
            module.init_mixer_parameters()


class HypeNetModel(HypeNetPreTrainedModel):
    def __init__(self, config: HypeNetConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(HypeNetDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
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
        info = sequence_info(x.shape[:2], x.device, position_ids, attention_mask, cu_seqlens,
                             max_seqlen, past)
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


@dataclass
class HypeNetCausalLMOutput(ModelOutput):
    """Our own output class: transformers renamed ``past_key_values`` to ``cache`` between 5.17 and
    5.24, and both attribute names work here. (Older generate looks the cache up in the output under
    ``past_key_values``, finds nothing and decodes on with the HypeNetCache it passed in, which the
    forward updated in place.)"""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: "HypeNetCache | None" = None
    hidden_states: tuple[torch.Tensor, ...] | None = None

    @property
    def past_key_values(self):
        return self.cache


class HypeNetForCausalLM(HypeNetPreTrainedModel, HypeNetGenerationMixin):
    """HypeNet with an LM head. ``generate`` is transformers' (every GenerationConfig option, beam
    search, streamers, ...) over a :class:`HypeNetCache` (generation_hypenet.py);
    ``cache_implementation="static"`` decodes through ``StaticDecoder`` (CUDA graphs on CUDA)."""

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

        ``return_hidden_only=True`` returns the final normed hidden states ``[B, T, d]`` and skips
        the LM head, so distillation losses can fuse the vocabulary projection (never ``[T, V]``
        logits).
        ``labels`` gives the usual shifted CE (for lm-eval / quick checks; training uses fused
        losses).
        ``return_dict`` (default ``config.return_dict``): a :class:`HypeNetCausalLMOutput`, else its
        tuple.
        """
        if output_attentions:
            raise ValueError("HypeNet does not return attention weights (its kernels never form "
                             "them)")
        cache = cache if cache is not None else past_key_values
        if use_cache and cache is None:
            cache = HypeNetCache(self.config.num_hidden_layers)
        plain = (inputs_embeds is None and cu_seqlens is None and labels is None
                 and not return_hidden_only and not output_hidden_states)
        # [B, 1, V], or None: the forward
        logits = self._static_step(cache, input_ids, attention_mask, plain)
        all_hidden = None
        if logits is None:
            hidden, all_hidden = self.model(
                input_ids, attention_mask, position_ids, cu_seqlens, max_seqlen, cache,
                inputs_embeds, bool(output_hidden_states),
            )
            if return_hidden_only:
                return hidden
            logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        out = HypeNetCausalLMOutput(
            loss=loss, logits=logits, cache=cache if use_cache else None,
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
        )
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        return out if return_dict else out.to_tuple()
