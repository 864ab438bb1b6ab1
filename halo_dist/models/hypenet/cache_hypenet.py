"""HypeNet's decoding cache: the attention layers' keys/values in preallocated buffers and the RNN
layers' recurrent states, driven by transformers' ``generate``; ``static=True`` hands one-token
steps to the CUDA-graph ``StaticDecoder`` (static_decode.py).

Exported with every checkpoint: torch and transformers only.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache
from .decode_options import DecodeOptions


# Extra KV slots a static (CUDA-graph) cache reserves: StaticDecoder's warm-up writes two tokens,
# then rewinds.
STATIC_WARMUP_TOKENS = 2


class HypeNetCache(Cache):
    """Per-layer decoding state: ``(k, v)`` ``[B, T, Hkv, D]`` for attention layers, the recurrent
    state ``[B, H, K, V]`` (fp32) for RNN layers, in ``layers[i]`` (None before the first forward).

    A ``transformers`` Cache, so ``generate`` drives it (beam search reorders it through
    ``reorder_cache``), but with its own layer storage: the mixers read and write ``layers``
    directly, and the attention keys live in preallocated buffers (``append_kv``).

    ``static=True`` (``generate(..., cache_implementation="static")``): after the prefill, one-token
    steps run through ``StaticDecoder`` on this cache's buffers (a CUDA-graph replay per token on
    CUDA, the same step eagerly elsewhere); ``max_cache_len`` then bounds the tokens it can hold,
    and ``static_options`` are the decoder's ``DecodeOptions`` (e.g.
    ``DecodeOptions(compile=True)``: pass the cache to ``generate`` as ``past_key_values``).
    """

    # A plain attribute, declared on the class so that it shadows transformers 5.17's read-only
    # (deprecated) ``Cache.max_cache_len`` property, which would refuse the assignment in __init__.
    max_cache_len: int | None = None

    def __init__(self, num_layers: int, reserve_tokens: int = 0, max_cache_len: int | None = None,
                 static: bool = False, static_options: DecodeOptions | None = None):
        super().__init__(layers=[None] * num_layers)
        self.seen_tokens = 0
        self.reserve_tokens = reserve_tokens  # room left after the prefill for decoded tokens
        # room for this many tokens in all, if more than prompt + reserve
        self.max_cache_len = max_cache_len
        self.static = static
        # how the StaticDecoder this cache builds runs its step
        self.static_options = static_options or DecodeOptions()
        self._kv_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._decoder = None  # the StaticDecoder that owns the buffers once static steps began

    def append_kv(self, layer_idx: int, k: torch.Tensor,
                  v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k/v ``[B, T, Hkv, D]`` to layer ``layer_idx``; returns views of all cached
        keys/values.

        The keys live in a buffer with spare room (grown by doubling), so a decode step writes one
        token instead of copying the whole cache (torch.cat would move O(T) bytes per token: 60 GB
        per step for a 1.7B-shape teacher at 512K)."""
        past = self.layers[layer_idx]
        used = 0 if past is None else past[0].shape[1]
        new = used + k.shape[1]
        buf = self._kv_buffers.get(layer_idx)
        if buf is None or buf[0].shape[1] < new or buf[0].shape[0] != k.shape[0]:
            # prefill: the prompt plus the reserved decode room; beyond it, grow by doubling
            room = (max(new + self.reserve_tokens, self.max_cache_len or 0) if past is None
                    else max(new, 2 * used))
            # [B, room, Hkv, D]
            grown = tuple(t.new_empty(t.shape[0], room, *t.shape[2:]) for t in (k, v))
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

    # --- static (CUDA-graph) decoding -------------------------------------------------------------

    def static_step(self, model, tokens: torch.Tensor,
                    attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Next-token logits ``[B, V]`` for ``tokens`` ``[B, 1]`` through the StaticDecoder (built
        on the first step from the prefilled buffers; ``attention_mask`` covers the prompt's left
        padding). None once the buffers are full (e.g. generation continued past ``max_cache_len``):
        the caller steps dynamically."""
        if self._decoder is None:
            from .static_decode import StaticDecoder

            room = min((buf[0].shape[1] for buf in self._kv_buffers.values()), default=None)
            if room is not None and room - self.seen_tokens < 1 + STATIC_WARMUP_TOKENS:
                return None
            prompt_mask = None if attention_mask is None else attention_mask[:, : self.seen_tokens]
            self._decoder = StaticDecoder(model, self, self.static_options,
                                          attention_mask=prompt_mask)
        elif self._decoder.room_left is not None and self._decoder.room_left < 1:
            self.leave_static()
            return None
        # the decoder's buffer is overwritten by the next step
        logits = self._decoder.step(tokens).clone()
        self.seen_tokens = self._decoder.length
        return logits

    def leave_static(self) -> None:
        """Hand the decoder's state back to ``layers`` (for a forward the static step cannot run, or
        a batch-size change); a later one-token step builds a new decoder."""
        dec = self._decoder
        if dec is None:
            return
        n = dec.length
        for i, entry in enumerate(dec.cache.layers):
            # RNN states go back in fp32 (a decoder may have kept them in bf16, and
            # held its last tokens beside them)
            self.layers[i] = ((entry[0][:, :n], entry[1][:, :n]) if isinstance(entry, tuple)
                              else dec.cache.rnn_state_values(i))
        self.seen_tokens = n
        self._decoder = None

    # --- transformers' Cache interface ------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """-1: the dynamic cache grows; a static one holds what its buffers were sized for."""
        return self.max_cache_len if self.static and self.max_cache_len else -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def has_previous_state(self, layer_idx: int | None = None,
                           state_idx: int | None = None) -> bool:
        return self.seen_tokens > 0

    def reset(self) -> None:
        self.layers = [None] * len(self.layers)
        self._kv_buffers.clear()
        self._decoder = None
        self.seen_tokens = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep rows ``beam_idx`` (beam search: the beams each new beam continues; any selection of
        rows)."""
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        batch = self.batch_size
        if batch > 0:
            self._select_rows(torch.arange(batch).repeat_interleave(repeats))

    def _select_rows(self, idx: torch.Tensor) -> None:
        """Rows ``idx`` of every KV buffer and recurrent state. Under a static decoder with the
        batch size unchanged, in place (the CUDA graph reads fixed addresses); otherwise into new
        tensors, the KV buffers keeping their spare room."""
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
                # [B', room, Hkv, D]
                buf = self._kv_buffers[i] = tuple(b.index_select(0, rows) for b in buf)
                self.layers[i] = (buf[0][:, :used], buf[1][:, :used])
            else:  # a sliding-window layer's rolling cache (no buffer)
                self.layers[i] = tuple(t.index_select(0, rows) for t in entry)

    def crop(self, tokens_to_remove: int) -> None:
        """Only ``crop(0)``: a recurrent state cannot be rewound to an earlier token."""
        if tokens_to_remove:
            raise NotImplementedError("HypeNetCache cannot drop tokens: RNN states cannot be "
                                      "rewound")

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
        """False: generate must not torch.compile the forward around this cache (static decoding
        captures its own graph)."""
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
        return [isinstance(e, tuple) and i not in self._kv_buffers
                for i, e in enumerate(self.layers)]

    @property
    def is_linear(self) -> list[bool]:
        """Which layers hold a recurrent state (known after the first forward)."""
        return [isinstance(e, torch.Tensor) for e in self.layers]

