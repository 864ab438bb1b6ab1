"""Synthetic retrieval documents: long filler text with facts stated once and recalled far later.

A converted student learns to retrieve over long distances only from tokens that need far context,
and in natural text few do. Each document made here is ~``--chars`` characters of the user's own
filler text (in order, paragraph by paragraph) into which facts are woven: an entity's attribute is
stated once at a random place, and recalled with its answer at a random later place, often tens of
thousands of characters on; a few earlier passages are also quoted again verbatim. Next-token
training on the recall lines (KL to the teacher where it is reliable, CE beyond) is a retrieval
signal at every distance the document spans.

The phrasings, names, attributes and value formats here are this module's own: none is the NIAH
evaluation's (``halo_dist.eval.niah``: its "special magic" templates, key words, 7-digit values and
UUIDs), and the filler is whatever text the user gives, so a student is never tuned on the
evaluation's prompts or haystacks. Keep the Wikipedia extracts the NIAH haystack uses out of the
filler.

    python -m data_prep.retrieval --filler 'text/*.jsonl' --out retrieval.jsonl --docs 3000 \\
        --chars 60000
    python -m data_prep.tokenize --input retrieval.jsonl ... # then as any other text

Deterministic: the same filler, arguments and seed give the same documents.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path
from typing import Iterable, Iterator

FACTS = (
    "{entity}'s {attr} is {value}.",
    "For the record, the {attr} of {entity} is {value}.",
    "Memo: {entity} -- {attr}: {value}.",
    "It was noted that {entity} uses {attr} {value}.",
)
RECALLS = (
    "Question: what is the {attr} of {entity}? Answer: {value}.",
    "Recall: {entity}'s {attr} -> {value}",
    "Looking back, {entity} had {attr} {value}.",
    "{entity} ({attr}): {value}",
)
QUOTE = 'As written earlier: "{span}"'
FIRST = ("Adele", "Bruno", "Carmen", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ingrid",
         "Jonas", "Keiko", "Lars", "Mirela", "Nikolai", "Olga", "Pavel", "Quentin", "Rosa",
         "Stefan", "Tamsin", "Ulrich", "Vera", "Wendell", "Xenia", "Yusuf", "Zora")
LAST = ("Abernathy", "Bergstrom", "Castellano", "Dovgan", "Eklund", "Fairweather", "Gallagher",
        "Holmberg", "Iwasaki", "Jablonski", "Kowalczyk", "Lindqvist", "Marchetti", "Nakagawa",
        "Okonkwo", "Petrovic", "Quiroga", "Rasmussen", "Sorensen", "Tanaka", "Underhill",
        "Vasquez", "Whitfield", "Yamamoto", "Zelenko")
PLACES = ("Ashford depot", "Brennan Street clinic", "Corvid Hall", "Delmar warehouse",
          "Eastgate library", "Fenwick observatory", "Granary Row office", "Harbourview annex",
          "Ironbridge lab", "Juniper Lane school")
ATTRS = ("access code", "badge number", "room number", "serial number", "locker number",
         "account number", "flight number", "phone extension", "batch label", "shelf code",
         "invoice number", "licence plate", "order number", "ticket number", "postal code")
WORDS = ("copper", "velvet", "granite", "saffron", "harbor", "thistle", "marble", "cedar", "indigo",
         "falcon", "juniper", "ember", "quartz", "willow", "obsidian", "meadow")


def entity(rng: random.Random) -> str:
    if rng.random() < 0.7:
        return f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    return f"the {rng.choice(PLACES)}"


def value(rng: random.Random) -> str:
    """A value in one of several formats (numbers of 3-9 digits but never 7, codes, word pairs):
    NIAH's needles are 7-digit numbers, and nothing trained or calibrated on may share that."""
    kind = rng.randrange(4)
    if kind == 0:
        n = rng.choice((3, 4, 5, 6, 8, 9))
        return str(rng.randrange(10 ** n // 10, 10 ** n))
    if kind == 1:
        letters = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(2))
        return f"{letters}-{rng.randrange(1000, 10000)}"
    if kind == 2:
        return f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-{rng.randrange(10, 100)}"
    return f"{rng.randrange(1, 29):02d}/{rng.randrange(1, 13):02d}/{rng.randrange(1950, 2040)}"


def make_document(paragraphs: Iterator[str], rng: random.Random, chars: int,
                  facts: int, quotes: int = 2) -> str:
    """One document of about ``chars`` characters: filler paragraphs in order, ``facts`` facts
    stated in its first 85% and each recalled with its answer after it (half of the recalls in the
    last 10%), and ``quotes`` earlier passages quoted again later."""
    body, size = [], 0
    while size < chars:
        p = next(paragraphs).strip()
        if p:
            body.append(p)
            size += len(p) + 2
    n = len(body)
    inserts: dict[int, list[str]] = {}  # paragraph index -> lines placed after it
    seen = set()
    for _ in range(facts):
        who, attr = entity(rng), rng.choice(ATTRS)
        if (who, attr) in seen:
            continue
        seen.add((who, attr))
        at = rng.randrange(0, max(1, int(0.85 * n)))
        fields = dict(entity=who, attr=attr, value=value(rng))
        inserts.setdefault(at, []).append(_sentence(rng.choice(FACTS).format(**fields)))
        inserts.setdefault(_recall_at(rng, at, n), []).append(
            _sentence(rng.choice(RECALLS).format(**fields)))
    for _ in range(quotes):
        src = rng.randrange(0, max(1, n // 2))
        words = body[src].split()
        if len(words) >= 12:
            start = rng.randrange(0, len(words) - 11)
            span = " ".join(words[start : start + rng.randint(12, 40)])
            inserts.setdefault(rng.randrange(src + 1, n) if src + 1 < n else n - 1, []).append(
                QUOTE.format(span=span))
    out = []
    for i, p in enumerate(body):
        out.append(p)
        out += inserts.get(i, [])
    return "\n\n".join(out)


def _sentence(line: str) -> str:
    return line[0].upper() + line[1:]


def _recall_at(rng: random.Random, at: int, n: int) -> int:
    """Where a fact stated after paragraph ``at`` (of ``n``) is recalled: half the time in the last
    10% of the document (the longest distances), else anywhere after it."""
    if at + 1 >= n:
        return n - 1
    low = max(at + 1, int(0.9 * n)) if rng.random() < 0.5 else at + 1
    return rng.randrange(low, n)


def filler_paragraphs(texts: Iterable[str]) -> Iterator[str]:
    """Paragraphs of the filler texts, in order, cycling over them forever."""
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError("the filler holds no text")
    for text in itertools.cycle(texts):
        yield from (p for p in text.split("\n\n") if p.strip())


def read_filler(paths: list[Path], text_field: str = "text") -> list[str]:
    """Texts of JSONL (``text_field``; ``.xz``/``.gz`` too) or plain-text files."""
    import gzip
    import lzma

    texts = []
    for path in paths:
        opener = {".xz": lzma.open, ".gz": gzip.open}.get(path.suffix, open)
        with opener(path, "rt", encoding="utf-8") as f:
            if ".jsonl" in path.name:
                texts += [json.loads(line)[text_field] for line in f if line.strip()]
            else:
                texts.append(f.read())
    return texts


def generate(texts: Iterable[str], docs: int, chars: int, facts: int | None = None,
             seed: int = 0) -> Iterator[str]:
    """``docs`` documents (``facts``: per document; default one per 2,000 characters)."""
    rng = random.Random(seed)
    paragraphs = filler_paragraphs(texts)
    for _ in range(docs):
        yield make_document(paragraphs, rng, chars, facts or max(1, chars // 2000))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--filler", nargs="+", required=True, type=Path,
                   help="text files: JSONL (a 'text' field; .xz/.gz too) or plain text")
    p.add_argument("--out", required=True, type=Path, help="JSONL to write ({'text', 'source'})")
    p.add_argument("--docs", type=int, default=1000)
    p.add_argument("--chars", type=int, default=60_000, help="characters per document (about)")
    p.add_argument("--facts", type=int, default=0, help="facts per document (0: chars / 2000)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    missing = [str(f) for f in a.filler if not f.is_file()]
    if missing:
        print(f"error: --filler: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    if a.docs < 1 or a.chars < 1000 or a.facts < 0:
        print("error: --docs must be >= 1, --chars >= 1000 and --facts >= 0", file=sys.stderr)
        return 2
    tmp = a.out.with_name(f".{a.out.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for doc in generate(read_filler(a.filler), a.docs, a.chars, a.facts or None, a.seed):
            f.write(json.dumps({"text": doc, "source": "retrieval"}, ensure_ascii=False) + "\n")
    tmp.replace(a.out)
    print(f"wrote {a.docs} documents to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
