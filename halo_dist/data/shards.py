"""Webdataset token shards: deterministic writing, fast indexing, zero-copy reading.

A shard is a plain (ustar) webdataset tar. Each sample is one document, or one piece of a long
document, stored as consecutive tar members sharing a key ``d<doc:012d>p<piece:05d>``:

- ``<key>.tokens.npy``: 1-D token array (``uint16`` or ``uint32``); the last piece of a document
  ends with the EOS id.
- ``<key>.piece.json`` (only for documents split into pieces):
  ``{"doc": int, "piece": int, "num_pieces": int, "continues": bool}``.

A shard written by :class:`ShardWriter` starts with a pax global header (tar's own metadata
record, which tar readers and webdataset skip) saying what its tokens are: ``halo_dist.dtype``,
``halo_dist.vocab_sha256`` (the tokenizer's vocabulary, as in the manifest) and
``halo_dist.max_id`` (the largest token id). :func:`read_shard_header` reads it from the first
kilobyte, so every shard of a large set can be checked against the manifest's tokenizer and the
model's vocabulary before training, without reading its tokens; the header is part of the shard's
bytes, so its sha256 covers it.

``wds.WebDataset(url).decode()`` reads these shards as they are. The loader instead indexes each
shard once (tar headers and npy headers only: :func:`scan_shard`) and reads token slices straight
from an ``mmap`` (:class:`ShardReader`), which makes exact random-access resume cheap.
"""
from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataError
from .fileio import atomic_open

TOKENS_EXT = "tokens.npy"
PIECE_EXT = "piece.json"
BLOCK = 512
_KEY_RE = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # webdataset's key/extension split
_NPY_DESCR = re.compile(rb"'descr':\s*'([<>|=]?[a-zA-Z]\d+)'")
_NPY_SHAPE = re.compile(rb"'shape':\s*\((\d+),?\)")
HEADER_PREFIX = "halo_dist."
_MAX_ID_DIGITS = 10  # fixed width: the header is written first and the final value patched in


def sample_key(doc: int, piece: int) -> str:
    """Tar key of piece ``piece`` of document ``doc``."""
    return f"d{doc:012d}p{piece:05d}"


def npy_bytes(tokens: np.ndarray) -> bytes:
    """Serialise a 1-D token array as ``.npy`` bytes (deterministic)."""
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(tokens), allow_pickle=False)
    return buf.getvalue()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class ShardWriter:
    """Write one shard atomically: a hidden tmp file that is renamed into place by :meth:`close`.

    Usage::

        with ShardWriter(path, vocab_sha256=...) as w:
            w.add(doc, piece, num_pieces, tokens)   # tokens: [n] uint16/uint32
        record = w.record    # {"samples", "docs", "tokens", "bytes", "sha256"}

    The shard's header (module doc) records the tokens' dtype, their largest id and
    ``vocab_sha256`` (the tokenizer's identity, when given). If the block raises, the tmp file is
    deleted and nothing appears under ``path``.
    """

    def __init__(self, path: str | os.PathLike, vocab_sha256: str | None = None):
        self.path = Path(path)
        self._ctx = atomic_open(self.path)
        self._file = self._ctx.__enter__()
        self._tar: tarfile.TarFile | None = None  # opened by the first sample: its dtype is known
        self._header: dict[str, str] = {} if vocab_sha256 is None else {
            f"{HEADER_PREFIX}vocab_sha256": vocab_sha256}
        self.samples = self.docs = self.tokens = self.max_id = 0
        self.record: dict | None = None

    def _open(self, dtype: np.dtype) -> tarfile.TarFile:
        """The header (tarfile writes none for a USTAR archive), then the tar after it."""
        self._header = {f"{HEADER_PREFIX}dtype": np.dtype(dtype).name, **self._header}
        self._file.write(tarfile.TarInfo.create_pax_global_header(self._header_values()))
        return tarfile.open(fileobj=self._file, mode="w", format=tarfile.USTAR_FORMAT)

    def _header_values(self) -> dict[str, str]:
        return {**self._header, f"{HEADER_PREFIX}max_id": f"{self.max_id:0{_MAX_ID_DIGITS}d}"}

    def _member(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        self._tar.addfile(info, io.BytesIO(data))

    def add(self, doc: int, piece: int, num_pieces: int, tokens: np.ndarray) -> None:
        """Append one sample (a whole document, or piece ``piece`` of ``num_pieces``)."""
        if tokens.ndim != 1 or len(tokens) == 0:
            raise ValueError(f"sample {sample_key(doc, piece)} needs a non-empty 1-D token array")
        if self._tar is None:
            self._tar = self._open(tokens.dtype)
        key = sample_key(doc, piece)
        self._member(f"{key}.{TOKENS_EXT}", npy_bytes(tokens))
        if num_pieces > 1:
            meta = {"continues": piece < num_pieces - 1, "doc": doc, "num_pieces": num_pieces,
                    "piece": piece}
            self._member(f"{key}.{PIECE_EXT}", json.dumps(meta, sort_keys=True).encode())
        self.samples += 1
        self.docs += int(piece == num_pieces - 1)
        self.tokens += len(tokens)
        self.max_id = max(self.max_id, int(tokens.max()))

    def close(self) -> dict:
        """Finish the tar (its header with the largest id), fsync and rename it into place; return
        its manifest record."""
        if self._tar is None:
            self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.USTAR_FORMAT)
        self._tar.close()
        if self._header:  # the same length: only the digits of max_id change
            self._file.seek(0)
            self._file.write(tarfile.TarInfo.create_pax_global_header(self._header_values()))
            self._file.seek(0, os.SEEK_END)
        self._ctx.__exit__(None, None, None)
        self.record = {"samples": self.samples, "docs": self.docs, "tokens": self.tokens,
                       "bytes": self.path.stat().st_size, "sha256": sha256_file(self.path)}
        return self.record

    def abort(self, exc: BaseException | None = None) -> None:
        """Drop the tmp file; nothing is written under the final name."""
        try:
            if self._tar is not None:
                self._tar.close()
        except Exception:
            pass
        err = exc if exc is not None else RuntimeError("aborted")
        try:
            self._ctx.__exit__(type(err), err, None)
        except BaseException:
            pass

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, typ, exc, tb) -> None:
        if typ is None:
            self.close()
        else:
            self.abort(exc)


def read_shard_header(path: str | os.PathLike) -> dict[str, str]:
    """The ``halo_dist.*`` fields of a shard's header (module doc), without the prefix: ``dtype``,
    ``max_id``, ``vocab_sha256``; empty for a shard without one (another tool's, or an older
    data_prep's). Reads the first kilobyte or so."""
    try:
        with open(path, "rb") as f:
            head = f.read(BLOCK)
            if len(head) < BLOCK or head[156:157] != b"g":
                return {}
            size = _octal(head[124:136], path, "pax header")
            data = f.read(min(size, 1 << 16))
    except OSError as e:
        raise DataError(f"cannot open shard: {e.strerror}", path) from None
    fields, pos = {}, 0
    while pos < len(data) and data[pos:pos + 1].isdigit():
        length, _, rest = data[pos:].partition(b" ")
        record = rest[:int(length) - len(length) - 2]  # "<length> <key>=<value>\n"
        key, _, value = record.decode("utf-8", "replace").partition("=")
        if key.startswith(HEADER_PREFIX):
            fields[key[len(HEADER_PREFIX):]] = value
        pos += int(length)
    return fields


@dataclass
class ShardIndex:
    """Where the token arrays of a shard's samples lie.

    Attributes:
        path: shard file.
        offsets: int64 [N] byte offset of each sample's first token in the file.
        lengths: int64 [N] tokens per sample.
        dtype: token dtype (same for all samples of a shard).
    """

    path: str
    offsets: np.ndarray
    lengths: np.ndarray
    dtype: np.dtype

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def _octal(field: bytes, path, name) -> int:
    text = field.split(b"\0", 1)[0].strip()
    if field[:1] and field[0] & 0x80:  # GNU base-256 size
        return int.from_bytes(field[1:], "big")
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise DataError("corrupt tar header (bad number field)", path, name) from None


def _header(buf, pos: int, path) -> tuple[str, int, bytes] | None:
    """Parse the 512-byte tar header at ``pos``; None at the end-of-archive zero block."""
    hdr = buf[pos:pos + BLOCK]
    if len(hdr) < BLOCK:
        raise DataError(f"truncated tar: header at byte {pos} is cut off", path)
    if hdr.count(0) == BLOCK:
        return None
    stored = _octal(hdr[148:156], path, f"header@{pos}")
    if stored != sum(hdr) - sum(hdr[148:156]) + 8 * 32:
        raise DataError(f"corrupt tar: header checksum mismatch at byte {pos}", path)
    name = hdr[0:100].split(b"\0", 1)[0]
    if hdr[257:262] == b"ustar" and hdr[345:500].strip(b"\0"):
        name = hdr[345:500].split(b"\0", 1)[0] + b"/" + name
    return name.decode("utf-8", "replace"), _octal(hdr[124:136], path, name), hdr[156:157]


def _npy_header(buf, pos: int, size: int, path, name: str) -> tuple[int, np.dtype, int]:
    """(header length, dtype, element count) of the ``.npy`` member at ``pos``."""
    if size < 10 or buf[pos:pos + 6] != b"\x93NUMPY":
        raise DataError("corrupt sample: tokens are not a .npy array", path, name)
    major = buf[pos + 6]
    if major == 1:
        hlen = 10 + int.from_bytes(buf[pos + 8:pos + 10], "little")
    else:
        hlen = 12 + int.from_bytes(buf[pos + 8:pos + 12], "little")
    head = bytes(buf[pos:pos + min(hlen, size)])
    m_d, m_s = _NPY_DESCR.search(head), _NPY_SHAPE.search(head)
    if hlen > size or m_d is None or m_s is None or b"'fortran_order': True" in head:
        raise DataError("corrupt sample: unreadable .npy header (need a 1-D array)", path, name)
    dtype = np.dtype(m_d.group(1).decode())
    count = int(m_s.group(1))
    if dtype.kind not in "ui" or hlen + count * dtype.itemsize != size:
        raise DataError("corrupt sample: .npy size does not match its header", path, name)
    return hlen, dtype, count


def scan_shard(path: str | os.PathLike) -> ShardIndex:
    """Index a shard's samples from its tar and npy headers (the token data is not read).

    Raises :class:`DataError` naming the file (and sample key) for a missing, truncated or corrupt
    tar, a sample without ``tokens.npy``, or mixed token dtypes.
    """
    path = str(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(f"cannot open shard: {e.strerror}", path) from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise DataError("empty shard file", path)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _scan(buf, size, path)


def _scan(buf, size: int, path: str) -> ShardIndex:
    offsets, lengths = [], []
    dtype, cur_key, cur_has = None, None, True
    pos, long_name, ended = 0, None, False
    while pos < size:
        parsed = _header(buf, pos, path)
        if parsed is None:
            ended = True
            break
        name, msize, typ = parsed
        data = pos + BLOCK
        if data + msize > size:
            raise DataError(f"truncated tar: member needs {msize} bytes at byte {data}, file has "
                            f"{size}", path, name)
        pos = data + (msize + BLOCK - 1) // BLOCK * BLOCK
        if typ in (b"L", b"x"):  # GNU long name / pax header: take its path for the next member
            raw = bytes(buf[data:data + msize])
            long_name = raw.rstrip(b"\0").decode() if typ == b"L" else _pax_path(raw)
            continue
        if long_name:
            name, long_name = long_name, None
        if typ not in (b"0", b"\0", b"7"):
            continue
        m = _KEY_RE.match(name)
        key, ext = (m.group(1), m.group(2)) if m else (name, "")
        if key != cur_key:
            if not cur_has:
                raise DataError("sample has no 'tokens.npy'", path, cur_key)
            cur_key, cur_has = key, False
        if ext != TOKENS_EXT:
            continue
        hlen, dt, count = _npy_header(buf, data, msize, path, key)
        if dtype is None:
            dtype = dt
        elif dt != dtype:
            raise DataError(f"mixed token dtypes in one shard ({dtype} and {dt})", path, key)
        if count == 0:
            raise DataError("sample has an empty token array", path, key)
        offsets.append(data + hlen)
        lengths.append(count)
        cur_has = True
    if not ended:
        raise DataError(f"truncated tar: no end-of-archive marker after byte {pos}", path)
    if not cur_has:
        raise DataError("sample has no 'tokens.npy'", path, cur_key)
    if not lengths:
        raise DataError("shard holds no samples", path)
    return ShardIndex(path, np.asarray(offsets, np.int64), np.asarray(lengths, np.int64), dtype)


def _pax_path(raw: bytes) -> str | None:
    for rec in raw.decode("utf-8", "replace").split("\n"):
        _, _, kv = rec.partition(" ")
        if kv.startswith("path="):
            return kv[5:]
    return None


class ShardReader:
    """Read token slices of an indexed shard through a read-only ``mmap`` (no copies until used)."""

    def __init__(self, index: ShardIndex):
        self.index = index
        try:
            self._file = open(index.path, "rb")
        except OSError as e:
            raise DataError(f"cannot open shard: {e.strerror}", index.path) from None
        self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)

    def tokens(self, sample: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Tokens ``[start:stop]`` of sample ``sample`` as a read-only view, shape [stop-start]."""
        n = int(self.index.lengths[sample])
        stop = n if stop is None else stop
        off = int(self.index.offsets[sample]) + start * self.index.dtype.itemsize
        return np.frombuffer(self._mm, self.index.dtype, stop - start, off)

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:  # a view still references it; the GC will release it
            pass
        self._file.close()
