"""Prompt sets and the prompt curriculum of on-policy distillation (OPAL).

A :class:`PromptSet` is a list of token-id prompts built once from its config (``opd.prompt_sets``
entry, :class:`halo_dist.config.opd_schema.PromptSetConfig`); its last ``heldout`` prompts never
train and make the held-out reverse-KL eval. The :class:`Curriculum` decides which sets are active
at a (step, horizon) -- a set switches in once ``step >= start_step`` and ``horizon >= min_horizon``
and out at ``stop_step`` -- and samples prompts from the active sets with probability proportional
to their weights. Sets are built lazily, when they first become active (retrieval prompts of 32K
tokens take a while to tokenize), identically on every rank; sampling uses a per-rank RNG whose
state goes into checkpoints.

With ``opd.lmbda < 1`` (TRL GKD's on-policy fraction) some steps train on fixed data instead of
rollouts: every training prompt then also carries a fixed continuation of up to ``opd.horizon_max``
tokens (``FIXED_CONTINUATION`` in config/opd_schema.py says which for each kind; a continuation that
ends before the cap ends with EOS, as a rollout would), cut to the current horizon when it trains.
Building them uses its own RNG, so the prompts are the same whatever ``lmbda`` is. With
``opd.fixed_full_horizon`` a fixed-data step draws only continuations that fill the horizon: each
document then trains exactly as many tokens as a rollout that does not stop at EOS.

Bad input fails with :class:`PromptError`: an empty set, an empty prompt, a prompt longer than the
set's ``max_prompt_tokens``, or a prompt that leaves no room for the current horizon inside
``opd.max_seq_len`` (checked for the whole set whenever it becomes active or the horizon grows).
"""

from __future__ import annotations

import json
import random
from array import array
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ..config.schema import OPDConfig, PromptSetConfig

from ..errors import HaloUserError


class PromptError(HaloUserError, ValueError):
    """A prompt set that cannot be used (message names the set and the problem)."""


@dataclass
class PromptSet:
    """Token-id prompts of one configured set; ``heldout`` never trains."""

    cfg: PromptSetConfig
    train: list[list[int]]
    heldout: list[list[int]] = field(default_factory=list)
    # the fixed continuation of each train prompt (int32 token ids; empty: none), when built for
    # lmbda < 1
    continuations: list[array] | None = None

    @property
    def name(self) -> str:
        return self.cfg.name

    @cached_property
    def fixed_index(self) -> list[int]:
        """Train prompts that have a fixed continuation to train on."""
        return [i for i, c in enumerate(self.continuations or []) if len(c)]

    @property
    def longest(self) -> int:
        return max(len(p) for p in self.train + self.heldout)


def _docs_from_file(path: Path) -> list[str]:
    if not path.is_file():
        raise PromptError(f"prompt file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    parts = [p.strip() for p in text.split("\n\n")] if "\n\n" in text else text.splitlines()
    return [p.strip() for p in parts if p.strip()]


def _jsonl_rows(cfg: PromptSetConfig) -> list[dict]:
    path = Path(cfg.path)
    if not path.is_file():
        raise PromptError(f"prompt set {cfg.name!r}: {path} does not exist")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise PromptError(f"prompt set {cfg.name!r}: {path}:{n} is not JSON ({err})") from None
        if not isinstance(row, dict) or cfg.text_field not in row:
            raise PromptError(f"prompt set {cfg.name!r}: {path}:{n} has no {cfg.text_field!r} key")
        if cfg.completion_field is not None and cfg.completion_field not in row:
            raise PromptError(f"prompt set {cfg.name!r}: {path}:{n} has no "
                              f"{cfg.completion_field!r} key (its completion_field)")
        out.append(row)
        if len(out) >= cfg.num_prompts:
            break
    return out


def _ending(ids: list[int], cap: int, eos: int | None) -> array:
    """A continuation of at most ``cap`` tokens: ``ids``, then EOS if it ends before the cap."""
    out = array("i", ids[:cap])
    if len(ids) < cap and eos is not None:
        out.append(eos)
    return out


def _prefixes(cfg: PromptSetConfig, docs, tokenizer, rng: random.Random, cap: int = 0,
              eos: int | None = None) -> tuple[list[list[int]], list[array]]:
    """Prefixes of random length in ``prompt_tokens`` from documents long enough to hold them, and
    (``cap`` > 0) the up to ``cap`` tokens of each document after its prefix."""
    lo, hi = cfg.prompt_tokens
    out, rests = [], []
    for text in docs:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < lo:
            continue
        k = rng.randint(lo, min(hi, len(ids)))
        out.append(ids[:k])
        if cap:
            rests.append(_ending(ids[k:k + cap], cap, eos))
        if len(out) >= cfg.num_prompts:
            break
    return out, rests


def build_prompt_set(cfg: PromptSetConfig, tokenizer, vocab_size: int, seed: int = 0,
                     continuation_tokens: int = 0, eos_token_id: int | None = None) -> PromptSet:
    """Tokenize / generate the prompts of one set (deterministic in ``seed``);
    ``continuation_tokens`` > 0: also each prompt's fixed continuation of at most that many tokens
    (module doc)."""
    rng = random.Random(f"{seed}:{cfg.name}")
    cap, eos = continuation_tokens, eos_token_id
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    conts = []
    if cfg.kind == "synthetic":
        lo, hi = cfg.prompt_tokens
        prompts = [[rng.randrange(4, vocab_size) for _ in range(rng.randint(lo, hi))]
                   for _ in range(cfg.num_prompts)]
        if cap:
            crng = random.Random(f"{seed}:{cfg.name}:continuations")
            conts = [array("i", (crng.randrange(4, vocab_size) for _ in range(cap)))
                     for _ in prompts]
    elif cfg.kind == "wiki":
        from ..assets.text import iter_wiki_texts

        prompts, conts = _prefixes(cfg, iter_wiki_texts(), tokenizer, rng, cap, eos)
    elif cfg.kind == "text_file":
        prompts, conts = _prefixes(cfg, _docs_from_file(Path(cfg.path)), tokenizer, rng, cap, eos)
    elif cfg.kind == "jsonl":
        rows = _jsonl_rows(cfg)
        prompts = [encode(str(r[cfg.text_field])) for r in rows]
        if cap:
            if cfg.completion_field is None:
                raise PromptError(f"prompt set {cfg.name!r}: fixed-data steps (opd.lmbda < 1) need "
                                  "its completion_field")
            conts = [_ending(encode(str(r[cfg.completion_field])), cap, eos) for r in rows]
    elif cfg.kind == "niah":
        samples = _niah_samples(cfg, tokenizer, seed)
        prompts = [x.input_ids for x in samples]
        # the template ends "... mentioned in the provided text is": the answer follows it
        conts = [_ending(encode(f" {x.answer}."), cap, eos) for x in samples] if cap else []
    else:  # guarded by the config Literal
        raise PromptError(f"prompt set {cfg.name!r}: unknown kind {cfg.kind!r}")
    return _finish(cfg, prompts, vocab_size, conts if cap else None)


def _niah_samples(cfg: PromptSetConfig, tokenizer, seed: int) -> list:
    """Retrieval prompts (RULER NIAH-Single-2: Wikipedia haystack, 7-digit needle) at
    ``lengths``."""
    from ..eval.niah import NiahBuilder

    builder = NiahBuilder(tokenizer, seed=seed)
    rng = random.Random(f"{seed}:{cfg.name}:depths")
    out = []
    for i in range(cfg.num_prompts):
        length = cfg.lengths[i % len(cfg.lengths)]
        out.append(builder.sample("niah_single_2", length, round(rng.random(), 3), i))
    return out


def _finish(cfg: PromptSetConfig, prompts: list[list[int]], vocab_size: int,
            conts: list[array] | None = None) -> PromptSet:
    if not prompts:
        raise PromptError(f"prompt set {cfg.name!r} ({cfg.kind}) is empty: no prompt could be "
                          f"built (prompt_tokens={list(cfg.prompt_tokens)}, path={cfg.path})")
    for i, p in enumerate(prompts):
        if not p:
            raise PromptError(f"prompt set {cfg.name!r}: prompt #{i} is empty")
        if cfg.max_prompt_tokens is not None and len(p) > cfg.max_prompt_tokens:
            raise PromptError(f"prompt set {cfg.name!r}: prompt #{i} has {len(p)} tokens, more "
                              f"than max_prompt_tokens={cfg.max_prompt_tokens}")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise PromptError(f"prompt set {cfg.name!r}: prompt #{i} has token id {bad[0]} outside "
                              f"the model vocabulary [0, {vocab_size}) (tokenizer/model mismatch)")
    if cfg.heldout >= len(prompts):
        raise PromptError(f"prompt set {cfg.name!r}: heldout={cfg.heldout} leaves none of its "
                          f"{len(prompts)} prompts for training")
    cut = len(prompts) - cfg.heldout
    if conts is not None:
        conts = conts[:cut]
        for i, c in enumerate(conts):
            bad = [t for t in c if not 0 <= t < vocab_size]
            if bad:
                raise PromptError(f"prompt set {cfg.name!r}: the fixed continuation of prompt "
                                  f"#{i} has token id {bad[0]} outside the model vocabulary [0, "
                                  f"{vocab_size})")
        if not any(len(c) for c in conts):
            raise PromptError(f"prompt set {cfg.name!r}: no training prompt has "
                              "a fixed continuation (every prefix took its whole "
                              "document and there is no EOS token): fixed-data steps "
                              f"(opd.lmbda < 1) have nothing to train on")
    return PromptSet(cfg, prompts[:cut], prompts[cut:], conts)


class Curriculum:
    """Active prompt sets by (step, horizon) and weighted sampling from them (see module doc)."""

    def __init__(self, opd: OPDConfig, tokenizer, vocab_size: int, rank: int = 0,
                 prebuilt: dict | None = None, eos_token_id: int | None = None):
        self.opd, self.tokenizer, self.vocab_size = opd, tokenizer, vocab_size
        self.eos_token_id = eos_token_id
        self.continuation_tokens = opd.horizon_max if opd.lmbda < 1.0 else 0  # fixed continuations
        self.sets: dict[str, PromptSet] = dict(prebuilt or {})
        self.rng = random.Random(f"{opd.seed}:curriculum:{rank}")
        self._checked: dict[str, int] = {}  # set name -> horizon it was last checked for
        # (set name, horizon) -> train prompts whose continuation fills the horizon
        # (opd.fixed_full_horizon)
        self._full: dict[tuple[str, int], list[int]] = {}

    def get(self, cfg: PromptSetConfig) -> PromptSet:
        if cfg.name not in self.sets:
            self.sets[cfg.name] = build_prompt_set(cfg, self.tokenizer, self.vocab_size,
                                                   self.opd.seed, self.continuation_tokens,
                                                   self.eos_token_id)
        return self.sets[cfg.name]

    def active(self, step: int, horizon: int) -> list[PromptSet]:
        """Sets switched in at ``(step, horizon)``; each is checked to fit ``horizon``."""
        cfgs = [c for c in self.opd.prompt_sets if step >= c.start_step and horizon >= c.min_horizon
                and (c.stop_step is None or step < c.stop_step)]
        if not cfgs:
            raise PromptError(f"no prompt set is active at step {step}, horizon {horizon}: check "
                              "the start_step / stop_step / min_horizon of opd.prompt_sets")
        sets = [self.get(c) for c in cfgs]
        for s in sets:
            self.check_fits(s, horizon)
        return sets

    def check_fits(self, s: PromptSet, horizon: int) -> None:
        """Every prompt of ``s`` plus ``horizon`` new tokens must fit ``opd.max_seq_len``."""
        if self._checked.get(s.name) == horizon:
            return
        room = self.opd.max_seq_len - horizon
        if s.longest > room:
            raise PromptError(
                f"prompt set {s.name!r} has a prompt of {s.longest} tokens, longer than "
                f"the {room} tokens left for the prompt at horizon {horizon} "
                f"(opd.max_seq_len={self.opd.max_seq_len}); raise "
                "max_seq_len, shorten the prompts, or switch the set in later "
                "(min_horizon/start_step)")
        self._checked[s.name] = horizon

    def sample(self, n: int, step: int, horizon: int) -> list[tuple[str, list[int]]]:
        """``n`` (set name, prompt ids) pairs from the active sets, weighted."""
        sets = self.active(step, horizon)
        weights = [s.cfg.weight for s in sets]
        picks = self.rng.choices(sets, weights=weights, k=n)
        return [(s.name, s.train[self.rng.randrange(len(s.train))]) for s in picks]

    def sample_fixed(self, n: int, step: int,
                     horizon: int) -> list[tuple[str, list[int], list[int]]]:
        """``n`` (set name, prompt ids, fixed continuation cut to ``horizon``) from the active sets,
        weighted."""
        sets = self.active(step, horizon)
        for s in sets:
            if not s.fixed_index:
                raise PromptError(f"prompt set {s.name!r} has no fixed continuations (built for "
                                  "opd.lmbda=1?): a fixed-data step cannot use it")
        picks = self.rng.choices(sets, weights=[s.cfg.weight for s in sets], k=n)
        out = []
        for s in picks:
            index = self.fixed_index(s, horizon)
            i = index[self.rng.randrange(len(index))]
            out.append((s.name, s.train[i], s.continuations[i][:horizon].tolist()))
        return out

    def fixed_index(self, s: PromptSet, horizon: int) -> list[int]:
        """The train prompts of ``s`` a fixed-data step draws from: those with a continuation, or
        with ``opd.fixed_full_horizon`` those whose continuation has at least ``horizon`` tokens
        (every train prompt when all are that long: the draws are then :meth:`sample`'s)."""
        if not self.opd.fixed_full_horizon:
            return s.fixed_index
        key = (s.name, horizon)
        if key not in self._full:
            self._full[key] = [i for i in s.fixed_index if len(s.continuations[i]) >= horizon]
            if not self._full[key]:
                raise PromptError(f"prompt set {s.name!r}: no fixed continuation has the {horizon} "
                                  "tokens of the horizon (opd.fixed_full_horizon): give longer "
                                  "completions or a shorter horizon")
        return self._full[key]

    def heldout(self) -> list[list[int]]:
        """Held-out prompts of every set that has some (sets built on demand)."""
        return [p for c in self.opd.prompt_sets if c.heldout for p in self.get(c).heldout]

    def state_dict(self) -> dict:
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
