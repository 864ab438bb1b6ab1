"""Static-shape decoding with CUDA graphs.

A dynamic decode step (``model(token, cache=HypeNetCache)``) costs ~1,000 small kernel launches from
Python for a 28-layer model: measured ~40 ms per token on an H200 at every context length, far above
the time to read the KV cache (BENCHMARKS.md). ``StaticDecoder`` turns a prefilled
``HypeNetCache`` into fixed-address buffers — the attention layers' preallocated
``[B, room, Hkv, D]`` keys/values, the RNN layers' fp32 states, a device position counter — so one
decode step has fixed shapes and no host syncs, captures it once as a CUDA graph and replays it per
token.

The step is the model's own forward: ``StaticDecodeCache`` stands in for ``HypeNetCache``; attention
layers call ``cache.decode_attention`` (write the new key/value at the device position, then the
split-KV kernel of ``decode_attention.py`` over the valid prefix), Lightning layers
``decode_in_place`` (the state updated in place, ``decode_lightning.py``; on CUDA one kernel per
layer between its two GEMMs) and the other RNN
layers ``cache.set_state`` (copy into the fixed state buffer). Each layer's input projections run as
one GEMM (``pack_input_projections``). On CPU (or with ``use_cuda_graph=False``) the same static
step runs eagerly; tests compare it token by token with the dynamic cache.

Left-padded batches (``generate``'s layout) work: row b's first ``pad[b]`` keys are skipped by the
attention and its positions count real tokens only (the RNN prefill already made pads identity
steps).
Full-attention and RNN mixers only (sliding-window layers keep a rolling cache: use the dynamic
path).

``model.generate(..., cache_implementation="static")`` is the usual way in: its HypeNetCache builds
a StaticDecoder after the prefill and sends every one-token step through it; a beam-search reorder
permutes the fixed buffers in place (``StaticDecodeCache.select_rows_``).

``compile=True`` runs the step through ``torch.compile`` before capture: Inductor fuses the ~30
elementwise kernels per layer (RoPE, casts, residual adds, gates) that set the graph's fixed
per-token cost.
"""

from __future__ import annotations

import gc
import warnings

import torch

from .decode_attention import decode_attention
from .decode_gemv import tune_gemv
from .decode_lightning import lightning_decode_, split_scratch
from .decode_options import DecodeOptions
from .lightning_state import (DeferredWrites, deferred_values, deferred_writes,
                              state_values, stored_state)
from .layers_hypenet import PackedLinears, rope_inv_freq
from .ops_rnn import lightning_log_decay


def mixers_without_low_precision_state(mixer_types) -> list[str]:
    """The model's mixer kinds that cannot decode from a bf16 RNN state: every RNN but Lightning
    (only its in-place kernel reads the state in bf16 and updates it in fp32)."""
    return sorted({k for k in mixer_types if k not in ("attention", "lightning")})


class StaticDecodeCache:
    """Fixed buffers of one decode batch; the model's mixers duck-type it like ``HypeNetCache``."""

    is_static = True
    # {(layer, "mixer" | "mlp"): PackedLinears}: input projections as one GEMM each
    # (``pack_input_projections``)
    packed: dict | None = None

    def __init__(self, cache, model_config, attention_mask: torch.Tensor | None = None,
                 options: DecodeOptions = DecodeOptions()):
        """``options.state_dtype``: keep the RNN states in this dtype (None: as prefilled, fp32);
        bf16 or ``FLOAT24`` (fp32 less its last byte, kept as bytes) only for models whose RNN
        layers are all Lightning (its in-place kernel rounds once per token, other mixers' kernels
        would take such a state as their fp32 input). ``options.state_write_every``: Lightning
        states written back every n tokens, the tokens between held as k/v
        (``lightning_state.DeferredWrites``; the same Lightning-only models)."""
        state_dtype, state_write_every = options.state_dtype, options.state_write_every
        kinds = model_config.mixer_types
        if "swa" in kinds:
            raise ValueError("static decode does not support sliding-window layers (rolling "
                             "cache); use the dynamic HypeNetCache")
        # Lightning layers update their state in place (``LightningMixer.decode_in_place``; else
        # fla's kernel + ``set_state``), on CUDA in one kernel with their norms, RoPE and gate
        # (``fuse_lightning``)
        self.lightning_in_place = options.lightning_in_place
        self.fuse_lightning = options.fuse_lightning
        self._check_state_options(state_dtype, state_write_every, kinds)
        T = cache.seen_tokens
        if T == 0:
            raise ValueError("static decode needs a prefilled cache (seen_tokens == 0)")
        self.layers: list = []
        room = None
        for i, entry in enumerate(cache.layers):
            if entry is None:
                raise ValueError(f"layer {i} has no cached state: prefill the prompt first")
            if isinstance(entry, tuple):
                if entry[0].shape[1] != T:
                    raise ValueError(f"layer {i} caches {entry[0].shape[1]} keys, not {T}: "
                                     "static decode needs every layer to hold all prompt keys")
                kbuf, vbuf = cache._kv_buffers[i]  # [B, room, Hkv, D], the first T valid
                room = kbuf.shape[1] if room is None else min(room, kbuf.shape[1])
                self.layers.append((kbuf, vbuf))
            else:  # [B, H, K, V] fp32 (or as state_dtype keeps it), updated in place
                self.layers.append(stored_state(entry, state_dtype or entry.dtype))
        self.room = room  # None: no attention layer (pure RNN), unbounded
        first = next(t for t in self._tensors())
        device, B = first.device, first.shape[0]
        # [B] buffer index of each row's next token: rows advance together, but a row can be
        # restarted on another prompt (``StaticDecoder.refill_row``)
        self.pos = torch.full((B,), T, dtype=torch.long, device=device)
        self.rows = torch.arange(B, device=device)  # [B], indexes the rows in per-row writes
        self.pad = self._left_pad(attention_mask, T, device)  # [B] keys to skip per row
        self.prompt_tokens = T
        # constants of every Lightning layer's step, made once here: computed in the step, each
        # layer would compute them again, in kernels of their own under torch.compile
        cfg = model_config
        self.lightning_log_decay = lightning_log_decay(cfg.num_attention_heads, device,
                                                       cfg.lightning_decay)  # [H] fp32
        self.rope_inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, device)  # [D/2] fp32
        # where the fused Lightning step splits a head over programs (few rows)
        self.lightning_scratch = (split_scratch(B, cfg.num_attention_heads, cfg.head_dim, device)
                                  if "lightning" in kinds else None)
        self.deferred = self._defer_writes(state_write_every, cfg)

    def _check_state_options(self, state_dtype, state_write_every, kinds) -> None:
        """The narrower or deferred state needs Lightning's in-place kernel for every RNN layer
        (the values themselves are checked by ``DecodeOptions``)."""
        wants = [f"a {state_dtype} RNN state"] if state_dtype not in (None, torch.float32) else []
        wants += [f"state_write_every={state_write_every}"] if state_write_every > 1 else []
        other = mixers_without_low_precision_state(kinds)
        if wants and (other or not self.lightning_in_place):
            raise ValueError(f"{' and '.join(wants)} needs Lightning's in-place decode kernel "
                             f"for every RNN layer; this model also has {other or 'it off'}")

    def _defer_writes(self, every: int, cfg) -> dict[int, DeferredWrites]:
        """Per Lightning layer, its held tokens' slots (empty: every token written). Every layer
        counts from the same ``state_base`` ``[B]``: where each row's states were last written
        whole (the prefill here; ``StaticDecoder._place_row`` for a refill)."""
        if every == 1:
            return {}
        self.state_base = self.pos.clone()
        B, H, D = self.pos.shape[0], cfg.num_attention_heads, cfg.head_dim
        return {i: deferred_writes(B, H, D, D, every, self.pos, self.state_base)
                for i, kind in enumerate(cfg.mixer_types) if kind == "lightning"}

    @property
    def seen_tokens(self) -> int:
        """1, not a count: the step reads its position from ``pos`` on the device, and the forward
        only needs to know that the cache holds tokens. A host count (the prompt's length, or one
        growing per token) would be a guard value under ``torch.compile``: a recompilation for
        every prompt width (or every token). ``prompt_tokens`` holds the prompt's length."""
        return 1

    @seen_tokens.setter
    def seen_tokens(self, value: int) -> None:
        """The model's forward bumps the count; ignored here (``StaticDecoder.length`` counts on the
        host)."""

    @staticmethod
    def _left_pad(attention_mask, T: int, device) -> torch.Tensor | None:
        """Pads per row ``[B]`` from the prompt's ``[B, T]`` mask (left padding only), None if
        none."""
        if attention_mask is None:
            return None
        mask = attention_mask.bool()
        if mask.shape[1] != T:
            raise ValueError(f"attention_mask covers {mask.shape[1]} tokens, the cache {T}")
        if bool((mask[:, :-1] & ~mask[:, 1:]).any()):
            raise ValueError("static decode needs left padding (a 0 in attention_mask after a 1 "
                             "found)")
        if not bool(mask[:, -1].all()):
            raise ValueError("a row of attention_mask has no real token")
        pad = (~mask).sum(1).to(device=device, dtype=torch.long)
        return pad if bool(pad.any()) else None

    def position_ids(self, batch: int) -> torch.Tensor:
        """``[B, 1]`` position of the next token in each row (real tokens before it), read on the
        device."""
        pos = self.pos.view(batch, 1)  # [B] -> [B, 1]
        return pos if self.pad is None else pos - self.pad[:, None]

    def _tensors(self):
        for entry in self.layers:
            yield from (entry if isinstance(entry, tuple) else (entry,))

    def rnn_states(self) -> list[torch.Tensor]:
        return [e for e in self.layers if not isinstance(e, tuple)]

    def step_buffers(self) -> list[torch.Tensor]:
        """What a step changes besides the KV buffers and ``pos``: the RNN states and the held
        tokens' slots (a warm-up restores them)."""
        return self.rnn_states() + [t for d in self.deferred.values() for t in (d.keys, d.values)]

    def rnn_state_values(self, layer_idx: int) -> torch.Tensor:
        """Layer ``layer_idx``'s RNN state as fp32 numbers ``[B, H, K, V]``, held tokens folded
        in (what the dynamic cache gets back)."""
        s = state_values(self.layers[layer_idx])
        d = self.deferred.get(layer_idx)
        return s if d is None else deferred_values(s, d, self.lightning_log_decay)

    def select_rows_(self, idx: torch.Tensor) -> None:
        """Rows ``idx`` (as many as the batch: a beam-search reorder) of every buffer, in place, so
        a captured graph keeps reading the same addresses."""
        idx = idx.to(self.pos.device)
        for t in self._tensors():
            t.copy_(t.index_select(0, idx))
        if self.pad is not None:
            self.pad.copy_(self.pad.index_select(0, idx))
        for t in [t for d in self.deferred.values() for t in (d.keys, d.values)] + (
                [self.state_base] if self.deferred else []):
            t.copy_(t.index_select(0, idx))
        self.pos.copy_(self.pos.index_select(0, idx))

    def decode_attention(self, layer_idx: int, q, k, v, scale: float) -> torch.Tensor:
        """Write k/v ``[B, 1, Hkv, D]`` at each row's ``pos``; attend q ``[B, 1, H, D]`` over keys
        ``pad..pos`` of its row."""
        kbuf, vbuf = self.layers[layer_idx]
        # [B, room, Hkv, D] at (b, pos[b]) <- [B, Hkv, D]
        kbuf.index_put_((self.rows, self.pos), k[:, 0])
        vbuf.index_put_((self.rows, self.pos), v[:, 0])
        return decode_attention(q, kbuf, vbuf, self.pos + 1, scale, self.pad)

    def lightning_step(self, layer_idx: int, q, k, v, log_decay, scale: float) -> torch.Tensor:
        """Lightning's state update in the fixed buffer, in place; q/k ``[B, 1, H, K]``, v
        ``[B, 1, H, V]`` -> o ``[B, 1, H, V]``."""
        return lightning_decode_(q, k, v, log_decay, scale, self.layers[layer_idx],
                                 self.deferred.get(layer_idx))

    def set_state(self, layer_idx: int, state: torch.Tensor) -> None:
        self.layers[layer_idx].copy_(state)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.prompt_tokens


def pack_input_projections(model, gemv: bool = False) -> dict:
    """Every decoder layer's input projections packed: the mixer's q/k/v (and output gate) and the
    MLP's gate/up, each group one GEMM (``PackedLinears``). A decode step at batch 1 is a chain of
    GEMVs, and cuBLAS runs a 2048 x 2048 one at a third of the GPU's bandwidth (a 2B-shape profile
    measured ~0.8 TB/s for the 4-8 MB q/k/v/o weights, 2.3 TB/s for the 25 MB MLP ones). Costs one
    more copy of those weights while the decoder lives. Each pack also carries its block's output
    linear, so that ``gemv`` (``decode_gemv``) reaches every projection of a layer."""
    packs = {}
    for layer in model.model.layers:
        idx = layer.mixer.layer_idx
        packs[(idx, "mixer")] = PackedLinears(layer.mixer.input_linears(), layer.mixer.o_proj,
                                              gemv)
        packs[(idx, "mlp")] = PackedLinears(layer.mlp.input_linears(), layer.mlp.down_proj, gemv)
    return packs


def _room_for_more_compilations(at_least: int = 256):
    """Every StaticDecoder compiles the same code object, once per buffer shape. Past dynamo's
    recompile limit
    (8) a new shape would silently run eagerly (e.g. a benchmark sweeping context lengths), so raise
    it for the decoder's first compiled step."""
    cfg = torch._dynamo.config
    key = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    return cfg.patch(**{key: max(getattr(cfg, key), at_least)})


class StaticDecoder:
    """Decode one token per ``step`` from a prefilled cache, as a CUDA graph replay on CUDA.

    >>> dec = StaticDecoder(model, cache)         # cache: HypeNetCache after the prompt's prefill
    >>> logits = dec.step(next_tokens)            # [B] -> [B, V] (a static buffer: copy to keep)
    """

    def __init__(self, model, cache, options: DecodeOptions | None = None,
                 attention_mask: torch.Tensor | None = None):
        """``options``: how the step runs (``DecodeOptions``; None: the defaults, the fast path).
        ``attention_mask``: the prompt's ``[B, T]`` mask when rows are left-padded. A compiled
        step compiles during the warm-up; a compiler failure falls back to the eager step and is
        kept in ``compile_error``. Packed projections are a copy of those weights, taken now: build
        a new decoder after the weights change. ``gemv_report`` keeps the GEMV kernel's timings
        against cuBLAS per weight shape."""
        options = options or DecodeOptions()
        self.options = options
        self.model = model
        self.compile_error: str | None = None
        self._compile_checked = False
        # unbound (called with self): a bound method stored on self would be a reference cycle,
        # and the decoder's buffers (tens of GB for a rollout batch) would outlive it until the
        # garbage collector happens to run
        compile = options.compile
        mode = compile if isinstance(compile, str) else None
        self._step_fn = (torch.compile(StaticDecoder._step_body, dynamic=False, mode=mode)
                         if compile else StaticDecoder._step_body)
        self.cache = StaticDecodeCache(cache, model.config, attention_mask, options)
        device = self.cache.pos.device
        B = next(self.cache._tensors()).shape[0]
        self.gemv_report: dict = {}
        if options.pack_projections:
            self._pack(B == 1 and device.type == "cuda" if options.gemv is None else options.gemv)
        self.tokens = torch.zeros(B, 1, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None  # the head's own output (``_step_body``)
        # tokens in each row's cache (host side; the graph reads cache.pos)
        self.row_lengths = [self.cache.prompt_tokens] * B
        self.graph = None
        self.graph_error: str | None = None
        want_graph = (device.type == "cuda" if options.use_cuda_graph is None
                      else options.use_cuda_graph)
        if want_graph:
            self._capture(options.warmup_steps)

    def _pack(self, gemv: bool) -> None:
        """The layers' projections packed (``pack_input_projections``); with ``gemv``, tuned
        against cuBLAS per weight shape (``gemv_report``)."""
        self.cache.packed = pack_input_projections(self.model, gemv)
        if gemv:
            self.gemv_report = tune_gemv([w for pack in self.cache.packed.values()
                                          for w in pack.weights()])

    @property
    def length(self) -> int:
        """Tokens in the cache: the longest row's (every row's, unless rows were refilled)."""
        return max(self.row_lengths)

    @property
    def room_left(self) -> int | None:
        room = self.cache.room
        return None if room is None else room - self.length

    @property
    def compiled(self) -> bool:
        return self._step_fn is not StaticDecoder._step_body

    def _step_body(self) -> torch.Tensor:
        """One step: the next-token logits ``[B, V]``, the head's own output, not a copy (at 512
        rollout rows a copy moved 2 x 155 MB per step); under the graph, the captured output
        tensor, which every replay rewrites in place."""
        position_ids = self.cache.position_ids(self.tokens.shape[0])  # [B, 1], no host read
        out = self.model(self.tokens, position_ids=position_ids, cache=self.cache, use_cache=True,
                         return_dict=True)
        self.cache.pos.add_(1)
        return out.logits[:, -1]  # [B, 1, V] -> [B, V]

    @torch.inference_mode()
    def _forward(self) -> None:
        if self.compiled and not self._compile_checked:
            self.logits = self._first_compiled_step()
        else:
            self.logits = self._step_fn(self)

    def _first_compiled_step(self) -> torch.Tensor:
        """Compile on the first step; on a compiler error restore the state and run the eager step
        instead. Returns the step's logits."""
        states = [s.clone() for s in self.cache.step_buffers()]
        pos = self.cache.pos.clone()
        try:
            with _room_for_more_compilations():
                logits = self._step_fn(self)
        except Exception as err:  # compiler trouble: keep decoding eagerly from the same state
            self.compile_error = f"{type(err).__name__}: {err}"
            # said aloud: a rollout batch on the eager step runs several times slower
            warnings.warn(f"StaticDecoder: torch.compile failed, decoding with the eager step "
                          f"({self.compile_error[:300]})", RuntimeWarning, stacklevel=2)
            self._step_fn = StaticDecoder._step_body
            self._restore(states, pos)
            logits = self._step_body()
        self._compile_checked = True
        # A compilation leaves dynamo's tracing objects as cyclic garbage, and they reference this
        # decoder's cache: collect them now, or the buffers outlive the decoder until the
        # collector happens to run (a rollout's ~25 GB stayed through OPD's training step)
        gc.collect()
        return logits

    @torch.inference_mode()
    def _capture(self, warmup_steps: int) -> None:
        """Warm up eagerly on a side stream (Triton compiles, autotunes), restore the state the
        warm-up advanced, then capture one step. A failure leaves eager static steps (reason in
        graph_error)."""
        if self.room_left is not None and self.room_left < warmup_steps:
            raise ValueError(f"the cache has room for {self.room_left} more tokens; need "
                             f"{warmup_steps} to warm up")
        states = [s.clone() for s in self.cache.step_buffers()]
        pos = self.cache.pos.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup_steps):
                self._forward()  # writes k/v at pos, pos + 1: rewritten before they are read again
        torch.cuda.current_stream().wait_stream(stream)
        self._restore(states, pos)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._forward()
            self.graph = graph
        except Exception as err:  # pragma: no cover - GPU only
            self.graph_error = f"{type(err).__name__}: {err}"
            warnings.warn(f"StaticDecoder: CUDA graph capture failed, stepping without a graph "
                          f"({self.graph_error[:300]})", RuntimeWarning, stacklevel=2)
            torch.cuda.synchronize()
        # (capture records kernels without running them: the restored state stands)

    def _restore(self, states: list[torch.Tensor], pos: torch.Tensor) -> None:
        for live, saved in zip(self.cache.step_buffers(), states):
            live.copy_(saved)
        self.cache.pos.copy_(pos)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens ``[B]`` (or ``[B, 1]``) -> next-token logits ``[B, V]`` (overwritten by the next
        step)."""
        if self.room_left is not None and self.room_left < 1:
            raise RuntimeError(f"the KV buffers are full ({self.cache.room} tokens): prefill with "
                               "a larger reserve")
        self.tokens.copy_(tokens.view(-1, 1))
        if self.graph is not None:
            self.graph.replay()
        else:
            self._forward()
        self.row_lengths = [n + 1 for n in self.row_lengths]
        return self.logits

    @torch.inference_mode()
    def refill_row(self, row: int, prefilled) -> None:
        """Restart row ``row`` on another prompt while the other rows go on where they are
        (continuous batching): ``prefilled`` is a batch-1 ``HypeNetCache`` after that prompt's
        forward; its keys/values and RNN states replace the row's, and the row's next token goes
        to position ``len(prompt)``, with no left padding. The captured graph reads the same
        buffers, so it needs no new capture."""
        T = prefilled.seen_tokens
        if self.cache.room is not None and T >= self.cache.room:
            raise ValueError(f"a {T}-token prompt does not fit the {self.cache.room}-token buffers")
        for entry, src in zip(self.cache.layers, prefilled.layers):
            if isinstance(entry, tuple):  # [B, room, Hkv, D] rows <- [1, T, Hkv, D]
                entry[0][row, :T].copy_(src[0][0])
                entry[1][row, :T].copy_(src[1][0])
            else:  # [B, H, K, V] <- [1, H, K, V] (as the decoder keeps its states)
                entry[row].copy_(stored_state(src[0], entry.dtype))
        self._place_row(row, T)

    def park_row(self, row: int) -> None:
        """A row with nothing left to decode keeps stepping with the others (the graph has a fixed
        batch); its position goes back to 0 so that it cannot run out of room, and its outputs are
        to be ignored."""
        self._place_row(row, 0)

    def _place_row(self, row: int, position: int) -> None:
        self.cache.pos[row] = position
        if self.cache.deferred:  # the row's states were just written whole
            self.cache.state_base[row] = position
        if self.cache.pad is not None:
            self.cache.pad[row] = 0
        self.row_lengths[row] = position

    @torch.inference_mode()
    def greedy(self, first: torch.Tensor, steps: int) -> torch.Tensor:
        """Greedy continuation: feed ``first [B]``, then each argmax; returns ``[B, steps]``
        tokens."""
        out, nxt = [], first.view(-1)
        for _ in range(steps):
            nxt = self.step(nxt).argmax(-1)
            out.append(nxt)
        return torch.stack(out, dim=1)
