"""OPD rollouts with continuous batching: a fixed number of decode slots, each restarted on the
next prompt as soon as its rollout ends (EOS or the horizon), so that short rollouts do not wait for
the longest one of their batch.

``sample_rollouts`` (opd.py) decodes a batch through ``generate`` and holds every row until the
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
(``rollout_sampling.sample_tokens``); ``temperature=0`` decodes greedily, which is how the tests
compare it with per-prompt decoding.
"""

from __future__ import annotations

import torch

from ..models.hypenet.cache_hypenet import STATIC_WARMUP_TOKENS, HypeNetCache
from .rollout_sampling import sample_tokens
from ..models.hypenet.modeling_hypenet import eager_decoder_layers
from ..models.hypenet.static_decode import StaticDecoder
from .opd import compiled_room, left_padded, static_options


class _TokenReader:
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


class _Slots:
    """The host side of the decode slots: which prompt each slot serves and its tokens so far."""

    def __init__(self, model, decoder: StaticDecoder, prompts, horizon, sampling, stop_token):
        self.model, self.decoder, self.prompts = model, decoder, prompts
        self.horizon, self.sampling, self.stop_token = horizon, sampling, stop_token
        self.serving: dict[int, int] = {}  # slot -> prompt index
        self.tokens: dict[int, list[int]] = {}  # slot -> sampled tokens of its rollout
        self.results: list[list[int] | None] = [None] * len(prompts)
        self.queue = iter(range(decoder.tokens.shape[0], len(prompts)))

    def ended(self, slot: int) -> bool:
        toks = self.tokens[slot]
        return bool(toks) and (len(toks) >= self.horizon
                               or (self.stop_token is not None and toks[-1] == self.stop_token))

    def settle(self, slot: int, next_tokens: torch.Tensor) -> None:
        """Retire the slot's rollout if it ended, and restart the slot on the next queued prompt
        (its first token, sampled from the prefill, goes into ``next_tokens`` on the device and
        reaches the host with the next read), or park it."""
        if slot not in self.serving or not self.ended(slot):
            return
        self.results[self.serving.pop(slot)] = self.tokens.pop(slot)
        idx = next(self.queue, None)
        if idx is None:
            self.decoder.park_row(slot)
            return
        next_tokens[slot] = self._prefill_into(slot, self.prompts[idx])
        self.serving[slot], self.tokens[slot] = idx, []

    @torch.no_grad()
    def _prefill_into(self, slot: int, prompt: list[int]) -> torch.Tensor:
        device = self.decoder.tokens.device
        cache = HypeNetCache(self.model.config.num_hidden_layers)
        ids = torch.tensor([prompt], dtype=torch.long, device=device)  # [1, T]
        logits = self.model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        self.decoder.refill_row(slot, cache)
        return sample_tokens(logits, *self.sampling)[0]


@torch.no_grad()
def continuous_rollouts(model, prompts: list[list[int]], horizon: int, slots: int, *,
                        temperature: float = 1.0, top_p: float = 1.0,
                        eos_token_id: int | None = None, stop_at_eos: bool = True,
                        generator: torch.Generator | None = None, pad_token_id: int = 0,
                        compile_static: bool = False,
                        state_dtype: torch.dtype | None = None) -> list[list[int]]:
    """One continuation per prompt (in the prompts' order; cut after the first EOS when
    ``stop_at_eos``), decoded in ``slots`` rows that are refilled as rollouts end.
    ``compile_static``: the step through ``torch.compile`` (the buffers' room rounded up by
    ``compiled_room``, so calls with similar prompts share a compilation). ``state_dtype``: the
    decoder's RNN state dtype (``sample_rollouts``)."""
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("an empty prompt cannot be continued")
    if slots < 1 or horizon < 1:
        raise ValueError(f"slots ({slots}) and horizon ({horizon}) must be positive")
    device = next(model.parameters()).device
    room = max(len(p) for p in prompts) + horizon + STATIC_WARMUP_TOKENS + 1
    if compile_static:
        room = compiled_room(room)
    ids, mask = (t.to(device) for t in left_padded(prompts[:slots], pad_token_id))
    sampling = (temperature, top_p, generator)
    was_training = model.training
    model.eval()
    try:
        with eager_decoder_layers(model):
            cache = HypeNetCache(model.config.num_hidden_layers, max_cache_len=room)
            logits = model(ids, attention_mask=mask, cache=cache, use_cache=True,
                           logits_to_keep=1).logits[:, -1]  # [B, V]
            decoder = StaticDecoder(model, cache, attention_mask=mask,
                                    **static_options(compile_static, state_dtype))
            return _decode(model, decoder, prompts, horizon, sampling,
                           eos_token_id if stop_at_eos else None, logits)
    finally:
        model.train(was_training)


def _decode(model, decoder, prompts, horizon, sampling, stop_token, logits) -> list[list[int]]:
    """Step every slot until each prompt has its rollout. Each iteration queues the next step on
    the GPU first, then reads the previous step's tokens and settles the slots."""
    state = _Slots(model, decoder, prompts, horizon, sampling, stop_token)
    for slot in range(decoder.tokens.shape[0]):
        state.serving[slot], state.tokens[slot] = slot, []
    cur = sample_tokens(logits, *sampling)  # [B] each slot's next token, on the device
    reader = _TokenReader(cur)
    while True:
        reader.start(cur)
        nxt = sample_tokens(decoder.step(cur), *sampling)  # [B], queued behind the copy
        for slot, tok in enumerate(reader.read()):
            if slot in state.serving:
                state.tokens[slot].append(tok)
        for slot in list(state.serving):
            state.settle(slot, nxt)
        if not state.serving:
            return state.results
        cur = nxt
