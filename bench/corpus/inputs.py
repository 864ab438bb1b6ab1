"""The ``build`` command's data sets: the carried text read back, the data_prep inputs written in a
fixed order (with the synthetic retrieval documents), their tokenization, and the mix tables of the
result."""

from __future__ import annotations

import argparse
import json
import lzma
import re
from pathlib import Path


def read_text_pack(folder: Path) -> list[tuple[str, list[str]]]:
    """(source, documents) of the carried ``NN-source.jsonl.xz`` files, in their priority order."""
    files = sorted(folder.glob("*.jsonl.xz"))
    if not files:
        raise SystemExit(f"error: no *.jsonl.xz in {folder} (run `pack` and carry its output)")
    out = []
    for f in files:
        docs, source = [], None
        with lzma.open(f, "rt", encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"error: {f}: line {n} is not JSON ({e.msg})") from None
                docs.append(rec["text"])
                source = rec["source"]
        if docs:
            out.append((source, docs))
    return out


def write_inputs(folder: Path, sets: list[tuple[str, list[str]]], min_chars: int = 0) -> list[dict]:
    """One ``NNNN-source.jsonl`` per source, in the given order; documents under ``min_chars``
    become empty records.

    The empty records keep every document at the same index in both data sets, so data_prep's
    index-hashed held-out split of ``long`` is exactly the long documents held out of ``all``: stage
    3 never trains on what the ``all`` evaluation holds out (data_prep counts and skips empty
    records).
    """
    folder.mkdir(parents=True, exist_ok=True)
    index = []
    for i, (source, docs) in enumerate(sets):
        path = folder / f"{i:04d}-{re.sub(r'[^A-Za-z0-9._-]+', '-', source)}.jsonl"
        kept = [d if len(d) >= min_chars else "" for d in docs]
        with open(path, "w", encoding="utf-8") as f:
            for d in kept:
                f.write(json.dumps({"text": d, "source": source}, ensure_ascii=False) + "\n")
        index.append({"file": path.name, "source": source, "documents": sum(1 for d in kept if d),
                      "characters": sum(map(len, kept))})
    return index


def training_side(natural: list[tuple[str, list[str]]], heldout: float,
                  seed: int = 0) -> list[tuple[str, list[str]]]:
    """The natural sources without the documents data_prep holds out (natural text is written
    first: document k of the corpus has index k)."""
    from data_prep.tokenize import is_heldout

    out, i = [], 0
    for source, docs in natural:
        out.append((source, [d for k, d in enumerate(docs, i) if not is_heldout(k, heldout, seed)]))
        i += len(docs)
    return out


def retrieval_set(natural: list[tuple[str, list[str]]], docs: int, chars: int, heldout: float,
                  seed: int = 0) -> tuple[str, list[str]]:
    """``docs`` synthetic retrieval documents (``data_prep.retrieval``) whose filler is the natural
    training text: not the Wikipedia extracts (the NIAH haystack) and not a held-out document."""
    from data_prep.retrieval import generate

    filler = [d for source, ds in training_side(natural, heldout, seed)
              if not source.startswith("wiki") for d in ds]
    return "retrieval", list(generate(filler, docs, chars, seed=seed))


def tokenize_set(a: argparse.Namespace, inputs: Path, out: Path, heldout: float) -> dict:
    """data_prep.tokenize over the inputs (it resumes, or returns at once when already complete)."""
    from data_prep.tokenize import build_parser, run

    argv = ["--input", *[str(p) for p in sorted(inputs.glob("*.jsonl"))], "--tokenizer",
            a.tokenizer, "--out", str(out), "--heldout-fraction", str(heldout), "--num-proc",
            str(a.num_proc)]
    if not a.progress:
        argv.append("--no-progress")
    return run(build_parser().parse_args(argv))


def mix_table(manifest: dict, index: list[dict]) -> list[dict]:
    """Per source: documents and tokens of train and held-out, from the manifest's ``sources``
    tables."""
    splits = manifest["splits"]
    rows = []
    for entry in index:
        row = {"source": entry["source"], "file": entry["file"], "documents": entry["documents"],
               "characters": entry["characters"]}
        for split in ("train", "heldout"):
            s = splits.get(split, {}).get("sources", {}).get(entry["file"],
                                                             {"docs": 0, "tokens": 0})
            row[f"{split}_docs"], row[f"{split}_tokens"] = s["docs"], s["tokens"]
        rows.append(row)
    return rows


def check_heldout_natural(rows: list[dict], where: str) -> int:
    """Held-out natural-language documents; raises if there are none (the eval would be code
    only)."""
    n = sum(r["heldout_docs"] for r in rows if not r["source"].startswith("code:"))
    if n == 0:
        raise SystemExit(f"error: {where}: the held-out split holds no natural-language document; "
                         "rebuild into a new --out with a larger --heldout-fraction, or carry more "
                         "text")
    return n


def print_mix(name: str, rows: list[dict], top_code: int = 20) -> None:
    """The mix of one data set: natural sources, the biggest code packages, the rest of the code
    summed."""
    natural = [r for r in rows if not r["source"].startswith("code:")]
    code = sorted((r for r in rows if r["source"].startswith("code:")),
                  key=lambda r: -r["train_tokens"])
    rest = code[top_code:]
    shown = natural + code[:top_code]
    if rest:
        shown.append({"source": f"code:other ({len(rest)} packages)",
                      **{k: sum(r[k] for r in rest) for k in ("documents", "train_tokens",
                                                              "heldout_tokens", "train_docs",
                                                              "heldout_docs")}})
    total = sum(r["train_tokens"] + r["heldout_tokens"] for r in rows) or 1
    print(f"\n{name}: {'source':<26} {'docs':>7} {'train tok':>12} {'heldout tok':>11} "
          f"{'ho docs':>7} {'share':>6}")
    for r in shown + [_sum_row("natural", natural), _sum_row("code", code),
                      _sum_row("total", rows)]:
        share = (r["train_tokens"] + r["heldout_tokens"]) / total
        print(f"{'':<{len(name) + 2}}{r['source']:<26} "
              f"{r['documents']:>7} {r['train_tokens']:>12,} "
              f"{r['heldout_tokens']:>11,} {r['heldout_docs']:>7} {share:>6.1%}")


def _sum_row(label: str, rows: list[dict]) -> dict:
    return {"source": label,
            **{k: sum(r[k] for r in rows) for k in ("documents", "train_tokens", "heldout_tokens",
                                                    "train_docs", "heldout_docs")}}
