"""The prompts of experiment arm d (``opd_arm.py``): retrieval prompts for on-policy distillation of
the real student, each with the reference continuation its teacher-forced control trains on.

A prompt is natural training text of the corpus with a few facts stated at random places in it,
and ends with the recall question of one of them (``Question: what is the badge number of Vera
Lindqvist? Answer:``). Its reference continuation is the answer, then the text that follows, in
which the other facts are recalled with their answers. Both arms train on positions after the
prompt: the on-policy arm on what the student writes there, the control on this text.

What the NIAH evaluation measures must not be trained on, so nothing here is its:
  * the facts, questions and values are ``data_prep.retrieval``'s (its phrasings, names,
    attributes and value formats: numbers of 3-9 digits but never 7, codes, word pairs, dates),
    never ``halo_dist.eval.niah``'s "special magic" templates, 7-digit needles or UUIDs;
  * the text is the carried natural text of the corpus without the Wikipedia extracts (the
    haystack of NIAH-S2/S3) and without any document the corpus holds out (perplexity reads them).
Prompt lengths keep prompt + horizon within the teacher's 8,192 trained positions, where its own
retrieval holds (100 / 96 / 90% NIAH-S1 at 2K / 4K / 8K; 0% beyond): the teacher that scores the
continuations knows the answers there.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from data_prep.retrieval import ATTRS, FACTS, RECALLS, entity, filler_paragraphs, value
from halo_dist.eval.calibrate_retrieval import recall_split

PARAGRAPH = "\n\n"
# filler paragraphs longer than this are skipped: one code listing or table of thousands of tokens
# would be most of a short prompt, or be dropped whole when a prompt is cut to its length
LONGEST_PARAGRAPH = 2000  # characters


@dataclass(frozen=True)
class PromptSpec:
    """What the prompt file holds: ``count`` prompts of ``prompt_tokens`` (a range) tokens, each
    with a continuation of at least ``continuation_tokens``, none longer than ``max_prompt_tokens``
    (the room left beside the horizon); ``seed`` draws the facts and lengths."""

    count: int
    prompt_tokens: tuple[int, int]
    continuation_tokens: int
    max_prompt_tokens: int
    seed: int = 0

    def __post_init__(self):
        lo, hi = self.prompt_tokens
        if not (self.count >= 1 and 1 <= lo <= hi <= self.max_prompt_tokens
                and self.continuation_tokens >= 1):
            raise SystemExit(f"error: OPD arm prompts: need count >= 1 and 1 <= min <= max <= "
                             f"{self.max_prompt_tokens} prompt tokens, got {self}")

    def key(self) -> str:
        """The file name's hash: arms built from the same spec read one file."""
        return hashlib.sha256(json.dumps(self.__dict__, sort_keys=True).encode()).hexdigest()[:10]


@dataclass
class Fact:
    statement: str  # stated once in the prompt
    question: str  # the recall line up to its value
    answer: str  # the value (with the space before it) and the template's end
    value: str
    key: tuple[str, str]  # entity and attribute


@dataclass
class Example:
    body: list[str]  # the prompt's paragraphs, facts included
    facts: list[Fact]
    rest: list[str] = field(default_factory=list)  # the continuation's paragraphs

    @property
    def prompt(self) -> str:
        return PARAGRAPH.join(self.body) + PARAGRAPH + self.facts[0].question

    @property
    def completion(self) -> str:
        return self.facts[0].answer + PARAGRAPH + PARAGRAPH.join(self.rest)


def capital(line: str) -> str:
    # data_prep.retrieval capitalizes its lines ("the Ashford depot" opens a sentence)
    return line[0].upper() + line[1:]


def make_fact(rng: random.Random) -> Fact:
    """A fact in data_prep.retrieval's words: its statement and its recall, split at the value."""
    fields = dict(entity=entity(rng), attr=rng.choice(ATTRS), value=value(rng))
    statement = capital(rng.choice(FACTS).format(**fields))
    template = rng.choice(RECALLS)
    question, answer = recall_split(template, fields)
    return Fact(statement, question, answer + template.split("{value}")[1], fields["value"],
                (fields["entity"], fields["attr"]))


def take(paragraphs, chars: int) -> list[str]:
    """Paragraphs of the filler stream, in order (but those over ``LONGEST_PARAGRAPH``), until they
    hold ``chars`` characters."""
    out, n = [], 0
    while n < chars:
        p = next(paragraphs).strip()
        if len(p) <= LONGEST_PARAGRAPH:
            out.append(p)
            n += len(p) + len(PARAGRAPH)
    return out


def make_example(paragraphs, rng: random.Random, tokens: int, continuation: int,
                 chars_per_token: float) -> Example:
    """One prompt of about ``tokens`` tokens with one fact per ~1,000 tokens (at least two) stated
    in its first 90%, asking for the first; its continuation (about twice ``continuation`` tokens,
    cut to the horizon when it trains) recalls the others in the text that follows."""
    body = take(paragraphs, int(1.3 * tokens * chars_per_token))  # cut to ``tokens`` later
    facts, seen = [], set()
    while len(facts) < max(2, tokens // 1000):
        fact = make_fact(rng)
        if fact.key not in seen:  # one value per entity and attribute
            seen.add(fact.key)
            facts.append(fact)
    for fact in facts:
        body.insert(rng.randrange(0, max(1, int(0.9 * len(body)))), fact.statement)
    rest = take(paragraphs, int(2 * continuation * chars_per_token))
    for fact in facts[1:]:
        rest.insert(rng.randrange(0, len(rest) + 1), fact.question + fact.answer)
    return Example(body, facts, rest)


def fit(example: Example, count, limit: int, spec: PromptSpec, paragraphs) -> tuple[int, int]:
    """Cut the example to its length in tokens (``count``: text -> tokens): drop filler paragraphs
    from the prompt's start while it holds more than ``limit`` tokens, add text to the
    continuation while it is shorter than the spec's. Returns the two token counts."""
    statements = {f.statement for f in example.facts}
    n_prompt = count(example.prompt)
    while n_prompt > limit:
        dropped = 0  # about as many tokens as the excess, counted paragraph by paragraph
        while dropped < n_prompt - limit:
            filler = [i for i, p in enumerate(example.body) if p not in statements]
            if not filler:
                raise SystemExit(f"error: OPD arm prompts: {len(example.facts)} facts alone take "
                                 f"{n_prompt - dropped} tokens, more than {limit}")
            dropped += count(example.body[filler[0]] + PARAGRAPH)
            del example.body[filler[0]]
        n_prompt = count(example.prompt)
    n_rest = count(example.completion)
    while n_rest < spec.continuation_tokens:
        example.rest += take(paragraphs, 4 * (spec.continuation_tokens - n_rest))
        n_rest = count(example.completion)
    return n_prompt, n_rest


def training_filler(text: Path, heldout: float, seed: int) -> list[str]:
    """The carried natural text the corpus trains on, without the Wikipedia extracts (the NIAH
    haystack) and without the documents its held-out split takes (``heldout``, ``seed``: the
    corpus's data_prep arguments)."""
    from bench.corpus.inputs import read_text_pack, training_side

    docs = [d for source, ds in training_side(read_text_pack(text), heldout, seed)
            if not source.startswith("wiki") for d in ds]
    if not docs:
        raise SystemExit(f"error: {text}: no natural training text besides the Wikipedia extracts "
                         "to build the OPD arm's prompts from")
    return docs


def chars_per_token(docs: list[str], tokenizer, sample: int = 200_000) -> float:
    text = PARAGRAPH.join(docs)[:sample]
    return len(text) / max(1, len(tokenizer(text, add_special_tokens=False)["input_ids"]))


def build(spec: PromptSpec, docs: list[str], tokenizer) -> list[dict]:
    """``spec.count`` rows ``{prompt, completion, prompt_tokens, completion_tokens, answer}``,
    deterministic in the spec and the text."""
    rng = random.Random(f"opd-arm/{spec.seed}")
    paragraphs = filler_paragraphs(docs)
    cpt = chars_per_token(docs, tokenizer)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    rows = []
    for _ in range(spec.count):
        tokens = rng.randint(*spec.prompt_tokens)
        example = make_example(paragraphs, rng, tokens, spec.continuation_tokens, cpt)
        n_prompt, n_rest = fit(example, count, min(tokens, spec.max_prompt_tokens), spec,
                               paragraphs)
        rows.append({"prompt": example.prompt, "completion": example.completion,
                     "prompt_tokens": n_prompt, "completion_tokens": n_rest,
                     "answer": example.facts[0].value})
    return rows


def prompt_file(folder: Path, spec: PromptSpec, text: Path, corpus: Path, tokenizer_dir: Path,
                name: str) -> Path:
    """``folder/<name>-<spec hash>.jsonl``, built once (atomically) from the carried text and the
    corpus's held-out split, with a ``.json`` report beside it; a second arm reads the same file."""
    out = folder / f"{name}-{spec.key()}.jsonl"
    if out.exists():
        print(f"[real] OPD arm prompts: {out} (built before)", flush=True)
        return out
    from transformers import AutoTokenizer

    t0 = time.time()
    manifest = corpus / "all" / "manifest.json"
    if not manifest.exists():
        raise SystemExit(f"error: no corpus manifest {manifest}: run `real_conversion.py corpus` "
                         "first")
    args = json.loads(manifest.read_text())["args"]
    docs = training_filler(text, args["heldout_fraction"], args["seed"])
    rows = build(spec, docs, AutoTokenizer.from_pretrained(tokenizer_dir))
    folder.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    lengths = sorted(r["prompt_tokens"] for r in rows)
    report = {"spec": spec.__dict__, "rows": len(rows), "filler_documents": len(docs),
              "prompt_tokens": {"min": lengths[0], "median": lengths[len(lengths) // 2],
                                "max": lengths[-1]},
              "completion_tokens_min": min(r["completion_tokens"] for r in rows),
              "seconds": round(time.time() - t0, 1)}
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    os.replace(tmp, out)
    print(f"[real] OPD arm prompts: {out} ({report})", flush=True)
    return out
