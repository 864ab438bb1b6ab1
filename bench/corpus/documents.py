"""Plain-text documents: cleaning, hashing, grouping records into documents, thinning evenly, and
reading the files and tools the sources come from."""

from __future__ import annotations

import gzip
import hashlib
import re
import shutil
import subprocess
from pathlib import Path
from typing import Iterable

GROUP_CHARS = 80_000  # tiny records are joined into documents of about this size ...
GROUP_MAX_CHARS = 100_000  # ... never past this (a larger single record stays whole)
MIN_DOC_CHARS = 200  # shorter documents are navigation stubs, not text


def normalize(text: str) -> str:
    """Readable plain text: no trailing spaces, no runs of blank lines, no control characters."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "", text)
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def content_hash(text: str) -> str:
    """Hash of the text with all whitespace runs collapsed (so re-wrapped copies collide)."""
    return hashlib.blake2b(" ".join(text.split()).encode(), digest_size=16).hexdigest()


def group_records(records: Iterable[str], target: int = GROUP_CHARS,
                  max_chars: int = GROUP_MAX_CHARS, sep: str = "\n\n") -> list[str]:
    """Join consecutive records into documents of about ``target`` characters (order kept).

    A record that would push a document past ``max_chars`` starts the next one; a short remainder at
    the end joins the last document where that stays within ``max_chars``.
    """
    docs, buf, size = [], [], 0
    for rec in records:
        if buf and size + len(rec) > max_chars:
            docs.append(buf)
            buf, size = [], 0
        buf.append(rec)
        size += len(rec) + len(sep)
        if size >= target:
            docs.append(buf)
            buf, size = [], 0
    if buf:
        if docs and size < target // 2 and sum(map(len, docs[-1] + buf)) <= max_chars:
            docs[-1] = docs[-1] + buf
        else:
            docs.append(buf)
    return [sep.join(d) for d in docs]


def dedupe(records: list[str], seen: set) -> tuple[list[str], int]:
    """Drop records whose whitespace-normalised text is in ``seen`` (updated); returns (kept,
    dropped)."""
    kept = []
    for rec in records:
        h = content_hash(rec)
        if h not in seen:
            seen.add(h)
            kept.append(rec)
    return kept, len(records) - len(kept)


def spread_keep(n: int, keep: int) -> list[int]:
    """Indices of ``keep`` of ``n`` items spread evenly (so a thinned dictionary keeps every
    letter)."""
    keep = max(0, min(n, keep))
    return [i for i in range(n) if (i + 1) * keep // n > i * keep // n]



def decode_bytes(data: bytes) -> str:
    """UTF-8, falling back to cp1252 for the odd legacy byte (GCIDE has three)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("cp1252", errors="replace")


def read_maybe_gz(path: Path) -> bytes:
    """The file's bytes, gunzipped when its name ends in ``.gz``."""
    return gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()


def require_dir(path: Path) -> Path:
    """``path``, which a source's Debian package installs."""
    if not path.is_dir():
        raise FileNotFoundError(f"{path} not found: install its Debian package (see "
                                "bench/build_corpus.py's docstring)")
    return path


def tool_output(cmd: list[str]) -> str:
    """The decoded output of a program that a source's Debian package installs."""
    if not shutil.which(cmd[0]):
        raise FileNotFoundError(f"{cmd[0]} not found: install its Debian package (see "
                                "bench/build_corpus.py's docstring)")
    return decode_bytes(subprocess.run(cmd, check=True, capture_output=True).stdout)

