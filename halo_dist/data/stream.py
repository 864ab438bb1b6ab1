"""The deterministic per-epoch token stream over a set of shards.

Epoch ``e`` of a data set is one long token sequence, identical on every rank and worker:

1. shards are permuted with ``rng(seed, e)`` (identity order when ``shuffle=False``);
2. consecutive groups of ``window`` shards form shuffle windows; the samples of a window are
   permuted with ``rng(seed, e, w)`` (the "sample buffer", exactly reproducible from its index);
3. samples are concatenated; window token totals come from the manifest, so any token offset maps
   to its window without reading other windows.

The loader cuts this sequence into rows of L tokens; :meth:`TokenStream.fetch` returns any token
range ``[a, b)`` of an epoch plus the offsets where samples start inside it.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .errors import DataError
from .manifest import ShardInfo
from .shards import ShardIndex, ShardReader, read_shard_header, scan_shard, sha256_file

log = logging.getLogger(__name__)
VERIFY_MODES = ("none", "size", "sha256", "full")


def check_shard(info: ShardInfo, verify: str) -> ShardIndex | None:
    """Check a shard against its manifest record; returns the scanned index for
    ``"sha256"``/``"full"``.

    ``size``: file exists with the recorded byte size. ``sha256``/``full``: also structure,
    sample/token counts, dtype and tokenizer (:func:`check_identity`) and checksum. Raises
    DataError naming file and key.
    """
    if verify == "none":
        return None
    try:
        size = os.stat(info.path).st_size
    except FileNotFoundError:
        raise DataError("shard file is missing", info.path) from None
    if info.bytes is not None and size != info.bytes:
        raise DataError(f"shard has {size} bytes, manifest says {info.bytes} (truncated or "
                        "replaced?)", info.path, "bytes")
    if verify == "size":
        return None
    index = scan_shard(info.path)
    check_counts(info, index)
    check_identity(info, index=index)
    if info.sha256 is not None and sha256_file(info.path) != info.sha256:
        raise DataError("shard sha256 differs from the manifest (corrupt or replaced)", info.path,
                        "sha256")
    return index


def check_counts(info: ShardInfo, index: ShardIndex) -> None:
    """Raise DataError if the scanned sample/token counts differ from the manifest record."""
    if info.samples is not None and index.num_samples != info.samples:
        raise DataError(f"shard holds {index.num_samples} samples, manifest says {info.samples}",
                        info.path, "samples")
    if info.tokens is not None and index.num_tokens != info.tokens:
        raise DataError(f"shard holds {index.num_tokens} tokens, manifest says {info.tokens}",
                        info.path, "tokens")


def check_identity(info: ShardInfo, header: dict | None = None,
                   index: ShardIndex | None = None) -> dict:
    """Refuse a shard that is not what its manifest says every shard is (``info.dtype``,
    ``info.vocab_sha256``): its header's dtype and tokenizer, or for a shard without a header the
    dtype of its samples (``index``). Returns the header (``read_shard_header`` unless given)."""
    header = read_shard_header(info.path) if header is None else header
    dtype = header.get("dtype") or (index.dtype.name if index is not None else None)
    if info.dtype and dtype and dtype != info.dtype:
        raise DataError(f"shard holds {dtype} tokens, its manifest says {info.dtype}: a shard of "
                        "another data set?", info.path, "dtype")
    vocab = header.get("vocab_sha256")
    if info.vocab_sha256 and vocab and vocab != info.vocab_sha256:
        raise DataError(f"shard was tokenized with another tokenizer than its manifest's "
                        f"(vocabulary sha256 {vocab[:12]}…, the manifest's "
                        f"{info.vocab_sha256[:12]}…): a shard of another data set?", info.path,
                        "tokenizer.vocab_sha256")
    return header


def max_token_id(info: ShardInfo, header: dict | None = None) -> int:
    """The largest token id in a shard: its header's record, else read from its tokens (one numpy
    pass over the shard: shards of another tool or an older data_prep)."""
    header = read_shard_header(info.path) if header is None else header
    if header.get("max_id", "").isdigit():
        return int(header["max_id"])
    reader = ShardReader(scan_shard(info.path))
    try:
        return max(int(reader.tokens(i).max()) for i in range(reader.index.num_samples))
    finally:
        reader.close()


@dataclass
class _Window:
    shard_ids: list[int]
    shard_of: np.ndarray  # [n] int64 position in shard_ids of each (permuted) sample
    sample_of: np.ndarray  # [n] int64 sample index inside its shard
    cum: np.ndarray  # [n+1] int64 token offset of each sample inside the window


class TokenStream:
    """Random access to the token sequence of any epoch (see module doc). Cheap to pickle."""

    def __init__(self, shards: list[ShardInfo], seed: int = 0, shuffle: bool = True,
                 window: int = 8, verify: str = "sha256", max_cached_windows: int = 2):
        if not shards:
            raise DataError("empty shard list")
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.shards, self.seed, self.shuffle = shards, int(seed), bool(shuffle)
        self.window, self.verify = max(1, int(window)), verify
        self.max_cached = max(2, max_cached_windows)
        self.shard_tokens = np.asarray([s.tokens for s in shards], np.int64)  # [num_shards]
        self.epoch_tokens = int(self.shard_tokens.sum())
        self._reset()

    def _reset(self) -> None:
        self._indices: dict[int, ShardIndex] = {}
        self._readers: dict[int, ShardReader] = {}
        self._windows: OrderedDict[tuple[int, int], _Window] = OrderedDict()
        self._bounds: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __getstate__(self):
        state = dict(self.__dict__)
        for k in ("_indices", "_readers", "_windows", "_bounds"):
            state.pop(k)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()

    def shard_order(self, epoch: int) -> np.ndarray:
        """[num_shards] shard ids in epoch ``epoch``'s order."""
        n = len(self.shards)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def _epoch_bounds(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(order [num_shards], window token starts [num_windows+1]) of an epoch."""
        if epoch not in self._bounds:
            order = self.shard_order(epoch)
            per_win = np.add.reduceat(self.shard_tokens[order],
                                      np.arange(0, len(order), self.window))
            self._bounds = {epoch: (order, np.concatenate([[0], np.cumsum(per_win)]))}
        return self._bounds[epoch]

    def _index(self, sid: int) -> ShardIndex:
        if sid not in self._indices:
            info = self.shards[sid]
            index = check_shard(info, self.verify) if self.verify in ("sha256", "full") else None
            if index is None:
                index = scan_shard(info.path)
                check_counts(info, index)
                check_identity(info, index=index)
            self._indices[sid] = index
        return self._indices[sid]

    def _load_window(self, epoch: int, w: int) -> _Window:
        key = (epoch, w)
        if key in self._windows:
            self._windows.move_to_end(key)
            return self._windows[key]
        order, _ = self._epoch_bounds(epoch)
        sids = [int(s) for s in order[w * self.window:(w + 1) * self.window]]
        idx = [self._index(s) for s in sids]
        # [n]
        shard_of = np.concatenate([np.full(ix.num_samples, j, np.int64)
                                   for j, ix in enumerate(idx)])
        sample_of = np.concatenate([np.arange(ix.num_samples, dtype=np.int64) for ix in idx])  # [n]
        lens = np.concatenate([ix.lengths for ix in idx])  # [n]
        if self.shuffle:
            perm = np.random.default_rng([self.seed, epoch, w]).permutation(len(lens))  # [n]
            shard_of, sample_of, lens = shard_of[perm], sample_of[perm], lens[perm]
        win = _Window(sids, shard_of, sample_of, np.concatenate([[0], np.cumsum(lens)]))
        self._windows[key] = win
        while len(self._windows) > self.max_cached:
            self._windows.popitem(last=False)
        self._sync_readers()
        return win

    def _sync_readers(self) -> None:
        live = {s for win in self._windows.values() for s in win.shard_ids}
        for sid in list(self._readers):
            if sid not in live:
                self._readers.pop(sid).close()
        for sid in live:
            if sid not in self._readers:
                self._readers[sid] = ShardReader(self._indices[sid])

    def fetch(self, epoch: int, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``[a, b)`` of epoch ``epoch``.

        Returns: tokens [b-a] (the shards' dtype), sample_starts [k] int64 offsets (relative to
        ``a``) where a sample begins inside the range.
        """
        if not 0 <= a < b <= self.epoch_tokens:
            raise IndexError(f"token range [{a}, {b}) outside epoch of {self.epoch_tokens} tokens")
        _, wstart = self._epoch_bounds(epoch)
        parts, starts, pos = [], [], a
        while pos < b:
            w = int(np.searchsorted(wstart, pos, "right")) - 1
            win, base = self._load_window(epoch, w), int(wstart[w])
            lo, hi = pos - base, min(b, int(wstart[w + 1])) - base
            i0 = int(np.searchsorted(win.cum, lo, "right")) - 1
            i1 = int(np.searchsorted(win.cum, hi, "left"))
            cum = win.cum
            for i in range(i0, i1):
                c = int(cum[i])
                reader = self._readers[win.shard_ids[win.shard_of[i]]]
                parts.append(reader.tokens(int(win.sample_of[i]), max(lo, c) - c,
                                           min(hi, int(cum[i + 1])) - c))
            first = i0 if cum[i0] == lo else i0 + 1
            starts.append(cum[first:i1] + (base - a))
            pos = base + hi
        return np.concatenate(parts), np.concatenate(starts)

    def close(self) -> None:
        """Release mmaps and caches."""
        for r in self._readers.values():
            r.close()
        self._reset()
