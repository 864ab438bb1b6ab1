"""RULER-style needle-in-a-haystack: NIAH-Single-1/2/3 at exact token lengths.

Tasks (RULER's templates):
  niah_single_1  haystack = repeated filler sentences, needle value = a 7-digit number
  niah_single_2  haystack = essay-like corpus text (offline Wikipedia extracts), 7-digit number
  niah_single_3  haystack = corpus text, needle value = a UUID

Every prompt is built so that ``len(tokenizer(prompt))`` equals the requested length exactly (the
haystack is cut at a token count found by re-tokenizing the whole prompt), and the needle starts at
the requested depth of the haystack (snapped to a nearby sentence end when one is close). Prompts
of one length share a token count, so a batch needs no padding. Decoding is greedy through the
model's ``generate`` (HypeNet's batched decoder or HF's); a sample is correct when the needle value
appears in the generated text as a whole token sequence (not inside a longer number/word).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .errors import EvalError
from .niah_report import cell_line, summarize
from .tokenizers import tokenizer_identity

TASKS = ("niah_single_1", "niah_single_2", "niah_single_3")
# What a report's figures depend on besides the model: prompts (templates, haystacks, lengths),
# decoding and scoring. Reference figures (a teacher's, reused across runs) are keyed by it: change
# it whenever one of those changes.
HARNESS_VERSION = 2
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
TEMPLATE = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards.\n{context}\n"
    "What is the special magic {kind_one} for {key} mentioned in the provided text? "
    "The special magic {kind_one} for {key} mentioned in the provided text is"
)
NEEDLE = " One of the special magic {kind} for {key} is: {value}. "
KEY_WORDS = (
    "amber", "brisk", "cobalt", "dusty", "eager", "fabled", "gentle", "hollow", "icy", "jolly",
    "keen", "lofty", "mellow", "nimble", "opal", "placid", "quiet", "rustic", "silent", "tidy",
    "umber", "vivid", "witty", "zesty",
)
KEY_NOUNS = (
    "anchor", "badger", "canyon", "dolphin", "ember", "falcon", "glacier", "harbor", "island",
    "jungle", "kettle", "lantern", "meadow", "nectar", "orchard", "pebble", "quarry", "river",
    "summit", "thicket", "valley", "willow",
)


@dataclass
class NiahSample:
    """One prompt: its ids (exactly ``length`` tokens), the answer and where the needle sits."""

    task: str
    length: int
    depth: float  # requested, in [0, 1] of the haystack
    key: str
    answer: str
    input_ids: list[int] = field(repr=False)
    needle_token: int  # index of the needle's first token in ``input_ids``
    needle_end: int  # one past the needle's last token
    context_start: int  # first haystack token
    context_end: int  # one past the last haystack token (needle included)

    @property
    def actual_depth(self) -> float:
        """Needle position as a fraction of the haystack tokens around it (0 = first, 1 = last)."""
        hay = (self.context_end - self.context_start) - (self.needle_end - self.needle_token)
        return (self.needle_token - self.context_start) / max(1, hay)


# ------------------------------------------------------------------------------------------------
# Lengths, keys, values, haystacks
# ------------------------------------------------------------------------------------------------


def parse_length(text: str) -> int:
    """``4096``, ``4K``/``4k`` (x1024), ``1M`` (x1024²) -> tokens."""
    t = str(text).strip().upper()
    mult = {"K": 1024, "M": 1024 * 1024}.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise EvalError(f"bad length {text!r}: use e.g. 4096, 4K, 128K or 1M") from None
    if value < 64:
        raise EvalError(f"length {text!r} = {value} tokens is too short for a NIAH prompt (min 64)")
    return value


def parse_lengths(text: str) -> list[int]:
    return [parse_length(t) for t in str(text).split(",") if t.strip()]


def parse_tasks(text: str) -> tuple[list[str], dict[str, int]]:
    """``niah_single_1,niah_single_2@8K`` -> the tasks and each one's longest length (if given)."""
    tasks, max_length = [], {}
    for item in (t.strip() for t in str(text).split(",")):
        if not item:
            continue
        name, _, cap = item.partition("@")
        if name not in TASKS:
            raise EvalError(f"unknown NIAH task {name!r}; choose from {', '.join(TASKS)} (each "
                            "optionally @LENGTH, its longest prompt: niah_single_2@8K)")
        tasks.append(name)
        if cap:
            max_length[name] = parse_length(cap)
    if not tasks:
        raise EvalError(f"no NIAH task given; choose from {', '.join(TASKS)}")
    return tasks, max_length


def parse_depths(text: str) -> list[float]:
    """``0,0.25,0.5,1`` or a count ``5`` (= evenly spaced 0..1)."""
    text = str(text).strip()
    if text.isdigit() and "," not in text:
        n = int(text)
        if n < 1:
            raise EvalError("--depths count must be >= 1")
        return [0.5] if n == 1 else [round(i / (n - 1), 4) for i in range(n)]
    try:
        depths = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise EvalError("--depths must be comma-separated fractions in [0, 1] or a count, got "
                        f"{text!r}") from None
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad or not depths:
        raise EvalError(f"--depths values must lie in [0, 1], got {bad or text!r}")
    return depths


def needle_value(task: str, rng: random.Random) -> str:
    if task == "niah_single_3":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return str(rng.randint(1_000_000, 9_999_999))


def needle_key(rng: random.Random) -> str:
    return f"{rng.choice(KEY_WORDS)}-{rng.choice(KEY_NOUNS)}"


class Haystack:
    """Token ids of a long haystack text for one tokenizer (built lazily, grown on demand)."""

    def __init__(self, tokenizer, kind: str, corpus: list[str] | None = None):
        self.tokenizer, self.kind = tokenizer, kind
        self.corpus = corpus
        self.ids: list[int] = []
        self._next_doc = 0

    def tokens(self, n: int) -> list[int]:
        """The first ``n`` haystack tokens (repeating the source if it runs out)."""
        while len(self.ids) < n:
            new = self._encode(self._next_text(n - len(self.ids)))
            if not new:
                raise EvalError("the tokenizer turns the haystack text into no tokens (an empty "
                                "tokenizer?)")
            self.ids.extend(new)
        return self.ids[:n]

    def _next_text(self, missing: int) -> str:
        if self.kind == "filler":
            return FILLER * max(1, missing // 16 + 1)
        docs = self._docs()
        parts, chars = [], 0
        while chars < 6 * missing + 1000:
            doc = docs[self._next_doc % len(docs)]
            self._next_doc += 1
            parts.append(doc)
            chars += len(doc) + 2
        return "\n\n".join(parts) + "\n\n"

    def _docs(self) -> list[str]:
        if self.corpus is None:
            from ..assets.text import iter_wiki_texts

            self.corpus = list(iter_wiki_texts())
        if not self.corpus:
            raise EvalError("the essay haystack corpus is empty")
        return self.corpus

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------------------
# Prompt construction at an exact token length
# ------------------------------------------------------------------------------------------------


class NiahBuilder:
    """Builds NIAH prompts for one tokenizer; haystacks are tokenized once and reused."""

    def __init__(self, tokenizer, corpus: list[str] | None = None, seed: int = 0):
        self.tokenizer, self.seed = tokenizer, seed
        self.haystacks = {"filler": Haystack(tokenizer, "filler"),
                          "essay": Haystack(tokenizer, "essay", corpus)}

    def sample(self, task: str, length: int, depth: float, index: int = 0) -> NiahSample:
        """One prompt of exactly ``length`` tokens with the needle at ``depth`` of the haystack."""
        if task not in TASKS:
            raise EvalError(f"unknown NIAH task {task!r}; choose from {', '.join(TASKS)}")
        rng = random.Random(f"{self.seed}:{task}:{length}:{depth}:{index}")
        key, value = needle_key(rng), needle_value(task, rng)
        kind = "uuids" if task == "niah_single_3" else "numbers"
        parts = {
            "needle": NEEDLE.format(kind=kind, key=key, value=value),
            "head": TEMPLATE.split("{context}")[0].format(kind=kind),
            "tail": TEMPLATE.split("{context}")[1].format(kind=kind, kind_one=kind[:-1], key=key),
        }
        hay = self.haystacks["filler" if task == "niah_single_1" else "essay"]
        ids, needle, ctx = self._fit(parts, hay, length, depth)
        return NiahSample(task, length, depth, key, value, ids, *needle, *ctx)

    def _fit(self, parts: dict, hay: Haystack, length: int, depth: float):
        """Find the haystack size n whose assembled prompt tokenizes to exactly ``length`` tokens.

        Newton-like steps on n first; token merges at the cuts can make that oscillate, so it then
        scans the haystack sizes next to the closest one.
        """
        fixed = len(self._encode(parts["head"] + parts["needle"] + parts["tail"]))
        if length - fixed < 1:
            raise EvalError(f"length {length} is too short: the template and needle alone take "
                            f"{fixed} tokens")
        tried: dict[int, int] = {}

        def attempt(n: int, shift: int = 0):
            text, needle_chars = self._assemble(parts, hay, n, depth, shift)
            ids = self._encode(text)
            tried.setdefault(n, len(ids))
            return (ids, *self._locate(text, needle_chars, parts)) if len(ids) == length else None

        n = length - fixed
        for _ in range(8):
            if n < 1 or n in tried:
                break
            found = attempt(n)
            if found:
                return found
            n += length - tried[n]
        best = min(tried, key=lambda m: (abs(tried[m] - length), m))
        for n in sorted(range(max(1, best - 16), best + 17), key=lambda m: abs(m - best)):
            if n not in tried and (found := attempt(n)):
                return found
        for n in sorted(range(max(1, best - 4), best + 5), key=lambda m: abs(m - best)):
            # move the needle cut: other merges at its boundaries
            for shift in (1, -1, 2, -2, 3, -3):
                if found := attempt(n, shift):
                    return found
        raise EvalError(f"could not build a prompt of exactly {length} tokens with this tokenizer "
                        f"(closest: {tried[best]})")

    def _assemble(self, parts: dict, hay: Haystack, n: int, depth: float,
                  shift: int = 0) -> tuple[str, int]:
        """Prompt text with ``n`` haystack tokens and the needle at ``depth``; returns (text, offset
        of needle).

        A character split by a cut (byte-level tokens) becomes one space instead of U+FFFD.
        """
        tokens = hay.tokens(n)
        cut = min(n, max(0, self._snap(tokens, round(depth * n)) + shift))
        before = _mend(self.tokenizer.decode(tokens[:cut]))
        after = _mend(self.tokenizer.decode(tokens[cut:]))
        head = parts["head"] + before
        return head + parts["needle"] + after + parts["tail"], len(head)

    def _snap(self, tokens: list[int], cut: int, window: int = 24) -> int:
        """Move ``cut`` to just after a nearby sentence end (within ``window`` tokens), if any."""
        best = None
        for delta in range(window + 1):
            for c in (cut - delta, cut + delta):
                if c == 0 or c == len(tokens) or (
                    0 < c < len(tokens)
                    and self.tokenizer.decode(tokens[c - 1 : c]).rstrip().endswith((".", "\n"))
                ):
                    best = c
                    break
            if best is not None:
                return best
        return cut

    def _locate(self, text: str, needle_chars: int,
                parts: dict) -> tuple[tuple[int, int], tuple[int, int]]:
        """Token spans ``[start, end)`` of the needle and of the haystack, from character
        offsets."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        tok_at = lambda ch: next((i for i, (s, e) in enumerate(offsets) if e > ch),  # noqa: E731
                                 len(offsets))
        needle = parts["needle"]
        start = tok_at(needle_chars + len(needle) - len(needle.lstrip()))
        end = tok_at(needle_chars + len(needle.rstrip()) - 1) + 1
        return (start, end), (tok_at(len(parts["head"])), tok_at(len(text) - len(parts["tail"])))

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def _mend(text: str) -> str:
    """Replace a run of U+FFFD (a multi-byte character cut by a token boundary) at either end by a
    space."""
    return re.sub("^\ufffd+", " ", re.sub("\ufffd+$", " ", text))


# ------------------------------------------------------------------------------------------------
# Scoring
# ------------------------------------------------------------------------------------------------


def answer_found(answer: str, generated: str) -> bool:
    """The exact needle value appears in ``generated``, not as part of a longer number/word/UUID."""
    pattern = r"(?<![0-9A-Za-z-])" + re.escape(answer.strip()) + r"(?![0-9A-Za-z-])"
    return re.search(pattern, generated, flags=re.IGNORECASE) is not None


# ------------------------------------------------------------------------------------------------
# Generation and the run
# ------------------------------------------------------------------------------------------------


def greedy_generate(model, tokenizer, rows: list[list[int]], max_new_tokens: int,
                    static: bool = False) -> list[str]:
    """Greedy continuations of (left-padded) prompts through the model's own ``generate``;
    ``static``: through HypeNet's static cache (CUDA-graph steps on CUDA, the split-KV attention
    kernel), ignored for other models."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad if pad is not None else 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, width - len(r):] = torch.tensor(r)
        mask[b, width - len(r):] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad,
            **({"cache_implementation": "static"} if static and supports_static_decode(model)
               else {}),
        )
    return [tokenizer.decode(row[width:], skip_special_tokens=True) for row in out.cpu()]


def supports_static_decode(model) -> bool:
    """HypeNet without sliding-window layers decodes through its static cache; other models keep
    theirs."""
    config = getattr(model, "config", None)
    return (getattr(config, "model_type", None) == "hypenet"
            and "swa" not in getattr(config, "mixer_types", ()))


@dataclass
class NiahConfig:
    tasks: list[str]
    lengths: list[int]
    depths: list[float]
    samples_per_cell: int = 1
    batch_size: int = 4
    max_new_tokens: int = 0  # 0: enough for the answer (from the tokenizer)
    seed: int = 0
    # > 0: prompts per batch = max(1, batch_tokens // length), at most batch_size. Long prompts then
    # go one at a time, so no padding mask is needed (HF's SDPA path materialises [B, 1, T, T] masks
    # for left-padded batches: 43 GB at 10 x 64K).
    batch_tokens: int = 0
    # decode HypeNet through its static cache (the split-KV attention kernel, CUDA graphs on a GPU).
    # With the dynamic cache, a 64K cell of 20 prompts took 16 s for short answers and 33 s for
    # UUIDs on an H200: about 0.25 s per extra batched step, far above what reading a 64K cache
    # costs
    static_decode: bool = False
    # a folder of built prompt cells (see PromptCache): teacher and student, or a re-run, tokenize
    # the haystacks once (about 0.35 s of CPU per 64K prompt)
    prompt_cache: str | None = None
    # task -> its longest length (``niah_single_2@8K``): the harder tasks can stop where the goals
    # that use them stop, which halves a 64K evaluation's prompts
    max_length: dict = field(default_factory=dict)

    def lengths_for(self, task: str) -> list[int]:
        return [L for L in self.lengths if L <= self.max_length.get(task, L)]

    def batch_for(self, length: int) -> int:
        if self.batch_tokens <= 0:
            return self.batch_size
        return max(1, min(self.batch_size, self.batch_tokens // max(1, length)))


def run_niah(model, tokenizer, cfg: NiahConfig, corpus: list[str] | None = None, log=print) -> dict:
    """Generate every (task, length, depth, sample) prompt, decode greedily, score; return the
    report dict."""
    builder = NiahBuilder(tokenizer, corpus, cfg.seed)
    cache = PromptCache(cfg.prompt_cache, builder) if cfg.prompt_cache else None
    records = []
    for task in cfg.tasks:
        for length in cfg.lengths_for(task):
            t0 = time.time()
            samples, source = (cache.cell(task, length, cfg) if cache
                               else (build_cell(builder, task, length, cfg), "built"))
            t1 = time.time()
            cell = _decode_and_score(model, tokenizer, samples, cfg)
            records += cell
            log(f"{task} @ {length}: {cell_line(cell)} ({time.time() - t0:.1f}s; prompts {source} "
                f"in {t1 - t0:.1f}s)")
    return {"config": asdict(cfg), "records": records, "summary": summarize(records),
            "harness": HARNESS_VERSION}


def build_prompt_cache(tokenizer, cfg: NiahConfig, corpus: list[str] | None = None,
                       log=print) -> None:
    """Build every cell of ``cfg`` into ``cfg.prompt_cache`` without a model (CPU only): a later
    evaluation with the same tokenizer and settings reads them instead of tokenizing the haystacks
    again."""
    if not cfg.prompt_cache:
        raise EvalError("building prompts needs a prompt cache folder")
    cache = PromptCache(cfg.prompt_cache, NiahBuilder(tokenizer, corpus, cfg.seed))
    for task in cfg.tasks:
        for length in cfg.lengths_for(task):
            t0 = time.time()
            samples, source = cache.cell(task, length, cfg)
            log(f"{task} @ {length}: {len(samples)} prompts {source} ({time.time() - t0:.1f}s)")


def build_cell(builder: "NiahBuilder", task: str, length: int, cfg: NiahConfig) -> list[NiahSample]:
    """The prompts of one (task, length) cell: every depth x ``samples_per_cell``."""
    return [builder.sample(task, length, d, k) for d in cfg.depths
            for k in range(cfg.samples_per_cell)]


class PromptCache:
    """Built prompt cells on disk, one JSON file per (task, length) cell, named by a hash of
    everything the prompts depend on: the tokenizer (its full serialisation), the haystack texts,
    the seed, the depths, the sample count and the templates. A different tokenizer or corpus is a
    different file, never a wrong hit; files are written atomically, so a killed run leaves none
    half-written."""

    VERSION = 1

    def __init__(self, folder: str | os.PathLike, builder: "NiahBuilder"):
        self.folder, self.builder = Path(folder), builder
        self._base: str | None = None

    def cell(self, task: str, length: int, cfg: NiahConfig) -> tuple[list[NiahSample], str]:
        """The cell's prompts and where they came from ("cached" or "built", then saved)."""
        path = self.folder / f"{task}_{length}_{self._key(task, length, cfg)[:16]}.json"
        if path.exists():
            return [NiahSample(**r) for r in json.loads(path.read_text())["samples"]], "cached"
        samples = build_cell(self.builder, task, length, cfg)
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"task": task, "length": length,
                                   "samples": [asdict(x) for x in samples]}))
        os.replace(tmp, path)
        return samples, "built"

    def _key(self, task: str, length: int, cfg: NiahConfig) -> str:
        cell = [self._base_key(), task, length, list(cfg.depths), cfg.samples_per_cell,
                self.builder.seed]
        return hashlib.sha256(json.dumps(cell).encode()).hexdigest()

    def _base_key(self) -> str:
        if self._base is None:
            hay = self.builder.haystacks["essay"]
            h = hashlib.sha256(json.dumps([self.VERSION, TEMPLATE, NEEDLE, FILLER,
                                           tokenizer_identity(self.builder.tokenizer)]).encode())
            for doc in hay._docs():
                h.update(hashlib.sha256(doc.encode()).digest())
            self._base = h.hexdigest()
        return self._base


def _decode_and_score(model, tokenizer, samples: list[NiahSample], cfg: NiahConfig) -> list[dict]:
    out = []
    step = cfg.batch_for(max(x.length for x in samples)) if samples else 1
    for s in range(0, len(samples), step):
        chunk = samples[s : s + step]
        new = (cfg.max_new_tokens
               or max(len(tokenizer(" " + x.answer, add_special_tokens=False)["input_ids"])
                      for x in chunk) + 8)
        texts = greedy_generate(model, tokenizer, [x.input_ids for x in chunk], new,
                                static=cfg.static_decode)
        for x, text in zip(chunk, texts):
            out.append({
                "task": x.task, "length": x.length, "depth": x.depth,
                "actual_depth": round(x.actual_depth, 4), "key": x.key, "answer": x.answer,
                "generated": text, "correct": answer_found(x.answer, text),
                "prompt_tokens": len(x.input_ids),
            })
    return out
