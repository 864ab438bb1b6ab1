"""OPD rollouts with continuous batching: a fixed number of decode slots, each restarted on the
next prompt as soon as its rollout ends (EOS or the horizon), so that short rollouts do not wait for
the longest one of their batch.

``sample_rollouts`` (stage.py) decodes a batch through ``generate`` and holds every row until the
last one stops; with EOS on, a batch's rows finish at very different steps and most slots idle
through the tail. Here one ``StaticDecoder`` keeps its fixed buffers (and its CUDA graph) for the
whole call: a finished slot gets the next prompt's keys/values and RNN states from a batch-1
prefill (``StaticDecoder.refill_row``) and the rows go on stepping together, each at its own
position. A slot with no prompt left is parked (``park_row``) until every slot is done.

The host never waits for the GPU to go idle: it reads a step's sampled tokens (a copy to pinned
memory, then an event) while the GPU already runs the next step, so the per-step host work (which
slots ended, refills) hides behind the step instead of following it. A rollout that ended is
therefore noticed one step late; that extra step's token for the slot is discarded, and the refill
replaces the slot's cache and position anyway.

The draws follow the student's own distribution under ``temperature`` / ``top_p``, with the
caller's generator (on the model's device), without a host sync
(``sampling.sample_tokens``); ``temperature=0`` decodes greedily, which is how the tests
compare it with per-prompt decoding.
"""

from __future__ import annotations

import torch

from ..models.hypenet.cache_hypenet import STATIC_WARMUP_TOKENS, HypeNetCache
from ..models.hypenet.decode_options import DecodeOptions
from ..models.hypenet.modeling_hypenet import eager_decoder_layers
from ..models.hypenet.static_decode import StaticDecoder
from .sampling import sample_tokens
from .stage import compiled_room, left_padded, static_options


class TokenReader:
    """Reads a step's sampled tokens on the host without waiting for work queued after them: an
    asynchronous copy into pinned memory and an event recorded behind it (a plain copy on CPU)."""

    def __init__(self, like: torch.Tensor):
        cuda = like.device.type == "cuda"
        self.host = torch.empty(like.shape, dtype=like.dtype, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None

    def start(self, tokens: torch.Tensor) -> None:
        self.host.copy_(tokens, non_blocking=self.event is not None)
        if self.event is not None:
            self.event.record()

    def read(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class _Work:
    """The call's prompts, the queue of those not yet started, the results, and
    how a rollout is sampled and when it ends."""

    def __init__(self, model, prompts, started: int, horizon, sampling, stop_token, options):
        self.model, self.prompts, self.horizon = model, prompts, horizon
        self.sampling, self.stop_token, self.options = sampling, stop_token, options
        self.queue = iter(range(started, len(prompts)))
        self.results: list[list[int] | None] = [None] * len(prompts)

    def ended(self, tokens: list[int]) -> bool:
        return bool(tokens) and (len(tokens) >= self.horizon
                                 or (self.stop_token is not None and tokens[-1] == self.stop_token))


class _Slots:
    """The decoder's slots: which prompt each slot serves, its tokens so far, and the step in
    flight."""

    def __init__(self, work: _Work, first: list[int], room: int, pad_token_id: int):
        self.work = work
        cache, mask, logits = prefill_prompts(work.model, [work.prompts[i] for i in first], room,
                                              pad_token_id)
        self.decoder = StaticDecoder(work.model, cache, work.options, attention_mask=mask)
        self.cur = sample_tokens(logits, *work.sampling)  # [b] each slot's next token
        self.reader = TokenReader(self.cur)
        self.serving = dict(enumerate(first))  # slot -> prompt index
        self.tokens: dict[int, list[int]] = {slot: [] for slot in self.serving}
        self.nxt: torch.Tensor | None = None

    def queue_step(self) -> None:
        """Copy the current tokens out and queue the next step behind the copy."""
        self.reader.start(self.cur)
        self.nxt = sample_tokens(self.decoder.step(self.cur), *self.work.sampling)  # [b]

    def settle(self) -> bool:
        """Read the tokens copied out by ``queue_step``, retire the rollouts that ended and refill
        or park their slots; False once no slot serves a prompt."""
        for slot, tok in enumerate(self.reader.read()):
            if slot in self.serving:
                self.tokens[slot].append(tok)
        for slot in list(self.serving):
            if self.work.ended(self.tokens[slot]):
                self._retire(slot)
        self.cur = self.nxt
        return bool(self.serving)

    def _retire(self, slot: int) -> None:
        """Keep the slot's rollout and restart the slot on the next queued prompt (its first token,
        sampled from the prefill, goes into the step in flight's tokens and reaches the host with
        the next read), or park it."""
        work = self.work
        work.results[self.serving.pop(slot)] = self.tokens.pop(slot)
        idx = next(work.queue, None)
        if idx is None:
            self.decoder.park_row(slot)
            return
        self.nxt[slot] = self._prefill_into(slot, work.prompts[idx])
        self.serving[slot], self.tokens[slot] = idx, []

    def _prefill_into(self, slot: int, prompt: list[int]) -> torch.Tensor:
        model = self.work.model
        cache = HypeNetCache(model.config.num_hidden_layers)
        device = self.decoder.tokens.device
        ids = torch.tensor([prompt], dtype=torch.long)  # [1, T]
        if device.type == "cuda":  # from pinned memory: a pageable copy would wait for the step
            ids = ids.pin_memory().to(device, non_blocking=True)
        logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        self.decoder.refill_row(slot, cache)
        return sample_tokens(logits, *self.work.sampling)[0]


def rollout_room(prompts: list[list[int]], horizon: int, compile_static: bool) -> int:
    """The decode buffers' room for ``prompts`` continued by ``horizon`` tokens (rounded up by
    ``compiled_room`` for a compiled step, so that calls with similar prompts share a
    compilation)."""
    room = max(len(p) for p in prompts) + horizon + STATIC_WARMUP_TOKENS + 1
    return compiled_room(room) if compile_static else room


def prefill_prompts(model, prompts: list[list[int]], room: int, pad_token_id: int):
    """The prompts' batched, left-padded forward into a cache with ``room`` tokens of space ->
    (cache, attention mask ``[b, T]``, last-position logits ``[b, V]``)."""
    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in left_padded(prompts, pad_token_id))  # [b, T]
    cache = HypeNetCache(model.config.num_hidden_layers, max_cache_len=room)
    logits = model(ids, attention_mask=mask, cache=cache, use_cache=True,
                   logits_to_keep=1).logits[:, -1]  # [b, V]
    return cache, mask, logits


@torch.no_grad()
def continuous_rollouts(model, prompts: list[list[int]], horizon: int, slots: int, *,
                        temperature: float = 1.0, top_p: float = 1.0,
                        eos_token_id: int | None = None, stop_at_eos: bool = True,
                        generator: torch.Generator | None = None, pad_token_id: int = 0,
                        compile_static: bool = False,
                        decoder_options: DecodeOptions | None = None) -> list[list[int]]:
    """One continuation per prompt (in the prompts' order; cut after the first EOS when
    ``stop_at_eos``), decoded in ``slots`` rows that are refilled as rollouts end.
    ``compile_static``: the step through ``torch.compile`` (the buffers' room rounded up by
    ``compiled_room``, so calls with similar prompts share a compilation). ``decoder_options``:
    the decoder's Lightning state options (``sample_rollouts``)."""
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("an empty prompt cannot be continued")
    if slots < 1 or horizon < 1:
        raise ValueError(f"slots ({slots}) and horizon ({horizon}) must be positive")
    room = rollout_room(prompts, horizon, compile_static)
    slots = min(slots, len(prompts))
    work = _Work(model, prompts, slots, horizon, (temperature, top_p, generator),
                 eos_token_id if stop_at_eos else None,
                 static_options(compile_static, decoder_options))
    was_training = model.training
    model.eval()
    try:
        with eager_decoder_layers(model):
            return _decode(work, slots, room, pad_token_id)
    finally:
        model.train(was_training)


def _decode(work: _Work, slots: int, room: int, pad_token_id: int) -> list[list[int]]:
    """Step the slots until each prompt has its rollout: queue the next step, then read the
    previous step's tokens and settle the slots while it runs."""
    run = _Slots(work, list(range(slots)), room, pad_token_id)
    while True:
        run.queue_step()
        if not run.settle():
            return work.results

