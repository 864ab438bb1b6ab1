"""Generation for HypeNet: transformers' ``generate`` (every GenerationConfig option, beam search,
streamers, ...) over a :class:`HypeNetCache`, with ``cache_implementation="static"`` decoding
through the CUDA-graph ``StaticDecoder``. Works with transformers 5.17 (the cache travels as
``past_key_values``) and 5.24+ (``cache``).

Exported with every checkpoint: torch and transformers only.
"""

from __future__ import annotations

import inspect

import torch
from transformers import GenerationMixin

from .cache_hypenet import STATIC_WARMUP_TOKENS, HypeNetCache

# The name generate keeps the cache under (transformers 5.24 renamed ``past_key_values`` to
# ``cache``).
_GENERATE_CACHE_KWARG = ("cache" if "cache" in inspect.signature(
    GenerationMixin.prepare_inputs_for_generation).parameters else "past_key_values")


class HypeNetGenerationMixin(GenerationMixin):
    """transformers' GenerationMixin with HypeNet's cache: what generate decodes with, how the
    prompt is sliced when a cache is reused, the padding side, and the static (CUDA-graph) one-token
    step of the forward."""

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args,
                                      **kwargs) -> None:
        """The cache ``generate`` decodes with: a :class:`HypeNetCache` sized for ``max_length``
        tokens (attention keys preallocated). ``cache_implementation``: None / "dynamic", or
        "static" for the StaticDecoder (CUDA-graph) steps; a cache passed by the caller must be a
        HypeNetCache."""
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
            raise ValueError("cache_implementation='static' does not support sliding-window layers "
                             "(their cache rolls); use the dynamic cache")
        tokens = generation_config.max_length
        if static:
            tokens = max(tokens, generation_config.max_cache_len or 0) + STATIC_WARMUP_TOKENS
        model_kwargs[key] = HypeNetCache(self.config.num_hidden_layers, max_cache_len=tokens,
                                         static=static)

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None,
                                      attention_mask=None, **kwargs):
        """transformers' preparation, which slices off the tokens a restarted cache holds only when
        some layer keeps keys: here the cache counts its tokens for RNN-only models too. The cache
        travels in ``kwargs`` under the installed transformers' name (``_GENERATE_CACHE_KWARG``)."""
        cache = kwargs.get(_GENERATE_CACHE_KWARG)
        seen = cache.get_seq_length() if isinstance(cache, HypeNetCache) else 0
        if (next_sequence_length is None and seen and input_ids.shape[1] > seen
                and kwargs.get("inputs_embeds") is None
                and (attention_mask is None or attention_mask.shape[1] == input_ids.shape[1])):
            next_sequence_length = input_ids.shape[1] - seen
        return super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, attention_mask=attention_mask,
            **kwargs)

    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, *args, **kwargs):
        """transformers' ``generate``, after checking the padding side: left padding is exact (pad
        keys are masked in attention, pad tokens are identity steps in the RNNs, positions count
        real tokens), so each row of a batch generates what it would alone; right padding would
        decode from a pad."""
        mask = kwargs.get("attention_mask")
        if (mask is not None and mask.dim() == 2
                and bool((mask[:, :-1].bool() & ~mask[:, 1:].bool()).any())):
            raise ValueError("generate() needs left padding (a 0 in attention_mask after a 1 "
                             "found)")
        if _GENERATE_CACHE_KWARG != "cache" and kwargs.get("cache") is not None:
            # transformers before the rename only knows past_key_values=: a cache passed as cache=
            # (the newer spelling) would otherwise reach the forward beside a fresh one that
            # generate made
            if kwargs.get(_GENERATE_CACHE_KWARG) is not None:
                raise ValueError("pass the cache as cache= or past_key_values=, not both")
            kwargs[_GENERATE_CACHE_KWARG] = kwargs.pop("cache")
        return super().generate(inputs, generation_config, *args, **kwargs)

    def _static_step(self, cache, input_ids, attention_mask, plain: bool) -> torch.Tensor | None:
        """The forward's logits ``[B, 1, V]`` from a static cache's StaticDecoder when the forward
        is a one-token step of token ids (``plain``: nothing asked that the static step cannot
        return: embeddings, packing, labels, hidden states); None otherwise, and then a static cache
        first hands the decoder's state back to its layers for the dynamic forward."""
        if not (isinstance(cache, HypeNetCache) and cache.static):
            return None
        if plain and cache.seen_tokens and input_ids is not None and input_ids.shape[1] == 1:
            # [B, V], or None: a dynamic step
            logits = cache.static_step(self, input_ids, attention_mask)
            if logits is not None:
                return logits[:, None]  # [B, V] -> [B, 1, V]
        cache.leave_static()
        return None
