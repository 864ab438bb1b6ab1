"""Data pipeline: pre-tokenized webdataset shards -> packed, resumable, DP/SP-aware micro-batches.

Public API::

    loader = build_loader("data/wiki/manifest.json", seq_len=512, micro_batch_size=8,
                          dp_rank=rank, dp_size=world, seed=0, num_workers=2)
    check_tokenizer("data/wiki/manifest.json", tokenizer)   # DataError on mismatch
    for batch in loader: ...                                # dicts of tensors (see PackedLoader)
    state = loader.state_dict(); loader.load_state_dict(state)
"""
from __future__ import annotations

import glob as _glob
import logging
import os
from pathlib import Path
from typing import Sequence

from .errors import DataError
from .loader import PackedLoader
from .manifest import (Manifest, ShardInfo, check_tokenizer, load_manifest, refuse_duplicates,
                       tokenizer_info, vocab_sha256)
from .packing import IGNORE_INDEX, pack_batch, sp_slice
from .shards import ShardWriter, scan_shard
from .stream import TokenStream, check_identity, check_shard, max_token_id

__all__ = ["DataError", "PackedLoader", "Manifest", "ShardInfo", "TokenStream", "ShardWriter",
           "IGNORE_INDEX", "build_loader", "resolve_shards", "check_tokenizer", "load_manifest",
           "tokenizer_info", "vocab_sha256", "pack_batch", "sp_slice", "scan_shard", "check_shard",
           "verify_share", "data_fingerprint", "check_share_fits"]
log = logging.getLogger(__name__)


def _expand(paths: Sequence[str | os.PathLike]) -> list[str]:
    out = []
    for p in paths:
        p = str(p)
        hits = sorted(_glob.glob(p)) if any(c in p for c in "*?[") else [p]
        if not hits:
            raise DataError("shard glob matched no files", p)
        out.extend(hits)
    return out


def resolve_shards(data, split: str = "train",
                   allow_incomplete: bool = False) -> tuple[list[ShardInfo], Manifest | None]:
    """Shards of ``data``: a manifest (file, folder or :class:`Manifest`), a tar path/glob, or a
    list of them.

    A bare shard list has no manifest: each shard is scanned for its counts (no checksum). A shard
    listed twice is refused (``refuse_duplicates``).
    """
    if isinstance(data, Manifest):
        refuse_duplicates(data.shards, data.path)
        return data.shards, data
    if isinstance(data, (str, os.PathLike)):
        p = Path(data)
        if p.suffix == ".json" or p.is_dir():
            m = load_manifest(p, split, allow_incomplete)
            refuse_duplicates(m.shards, m.path)
            return m.shards, m
        data = [data]
    paths = _expand(list(data))
    if not paths:
        raise DataError("empty shard list")
    refuse_duplicates([ShardInfo(path) for path in paths])
    infos = []
    for path in paths:
        ix = scan_shard(path)
        infos.append(ShardInfo(path, ix.num_samples, ix.num_tokens, os.path.getsize(path), None))
    return infos, None


def data_fingerprint(data, split: str = "train") -> str:
    """What identifies the token stream of ``data`` wherever it lies (the shards' names, counts and
    checksums): the fingerprint a loader over all of its shards records in its state."""
    shards, _ = resolve_shards(data, split)
    return Manifest(None, split, shards).fingerprint()


def verify_share(data, split: str, rank: int, world: int) -> list[str]:
    """Fully check this rank's share of the shards (every ``world``-th, from ``rank``): structure,
    sample and token counts, sha256 against the manifest. Returns one message per bad shard (empty:
    all good); the ranks together cover every shard once, so a corrupt shard is found before
    training starts instead of when it is first read, hours later."""
    shards, _ = resolve_shards(data, split)
    return [msg for _, msg in _bad_shards(shards[rank::world])]


def check_share_fits(data, split: str, vocab: int | None, rank: int, world: int) -> list[str]:
    """This rank's share of the shards (every ``world``-th, from ``rank``) holds what the manifest
    says (each shard's dtype and tokenizer: :func:`check_identity`) and only token ids below
    ``vocab`` (None: not checked). Reads each shard's header; a shard without one is scanned.
    Returns one message per shard that does not fit (empty: all fit)."""
    shards, _ = resolve_shards(data, split)
    bad = []
    for info in shards[rank::world]:
        try:
            top = max_token_id(info, check_identity(info))
        except DataError as e:
            bad.append(str(e))
            continue
        if vocab is not None and top >= vocab:
            bad.append(f"{info.path} holds token id {top}, beyond the model's vocabulary of "
                       f"{vocab:,} ids")
    return bad


def _bad_shards(shards: list[ShardInfo]) -> list[tuple[ShardInfo, str]]:
    """The shards that fail the full check, each with its error message."""
    bad = []
    for s in shards:
        try:
            check_shard(s, "full")
        except DataError as e:
            bad.append((s, str(e)))
    return bad


def _drop_corrupt(shards: list[ShardInfo]) -> tuple[list[ShardInfo], list[tuple[str, str]]]:
    bad = _bad_shards(shards)
    for s, msg in bad:
        log.warning("skipping corrupt shard %s: %s", s.path, msg)
    if bad:
        log.warning("skipped %d of %d shards as corrupt", len(bad), len(shards))
    if len(bad) == len(shards):
        raise DataError(f"all {len(shards)} shards are corrupt")
    dropped = {id(s) for s, _ in bad}
    return [s for s in shards if id(s) not in dropped], [(s.path, msg) for s, msg in bad]


def build_loader(data, seq_len: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 sp_rank: int = 0, sp_size: int = 1, seed: int = 0, num_workers: int = 0, *,
                 split: str = "train", shuffle: bool = True, shuffle_window: int = 8,
                 verify: str = "sha256", skip_corrupt: bool = False, max_epochs: int | None = None,
                 tokenizer=None, eos_id: int | None = None, allow_incomplete: bool = False,
                 prefetch_factor: int = 4, pin_memory: bool = False) -> PackedLoader:
    """Build the packed loader for one (DP rank, SP rank).

    Args:
        data: manifest path/folder/:class:`Manifest`, a shard path or glob, or a list of those.
        seq_len: L, tokens per row. micro_batch_size: B, rows per batch.
        dp_rank/dp_size, sp_rank/sp_size: this process's place in the DP x SP grid; SP ranks of one
            DP group get column slices of the same batch.
        seed: shuffling seed (shards and samples, per epoch). shuffle=False keeps file order.
        shuffle_window: shards whose samples are shuffled together (the sample buffer).
        verify: "size" (stat only), "sha256" (also structure, counts and checksum of each shard when
            first used), "full" (all of that up front), "none".
        skip_corrupt: check every shard up front and drop bad ones (logged, with their count)
            instead of raising.
        max_epochs: stop after this many epochs (None: endless).
        tokenizer / eos_id: if given, refuse shards made with another tokenizer / EOS.
    Returns: a :class:`PackedLoader` yielding input_ids/position_ids/labels [B, L/sp] int64,
        cu_seqlens [S+1] int32, max_seqlen int (and sp_rank/sp_size when sp_size > 1).
    """
    shards, manifest = resolve_shards(data, split, allow_incomplete)
    if tokenizer is not None or eos_id is not None:
        if manifest is None:
            raise DataError("cannot check the tokenizer of bare shards: pass a manifest")
        if tokenizer is not None:
            check_tokenizer(manifest, tokenizer, eos_id)
        elif int(manifest.tokenizer.get("eos_id", -1)) != int(eos_id):
            raise DataError(f"EOS mismatch: shards use {manifest.tokenizer.get('eos_id')}, model "
                            f"expects {eos_id}", manifest.path, "tokenizer.eos_id")
    skipped = []
    if skip_corrupt:
        shards, skipped = _drop_corrupt(shards)
    elif verify in ("size", "sha256", "full"):
        for s in shards:
            check_shard(s, "full" if verify == "full" else "size")
    # what is left to check on first use
    lazy = "sha256" if verify == "sha256" and not skip_corrupt else "size"
    stream = TokenStream(shards, seed, shuffle, shuffle_window, lazy)
    fp = Manifest(None, split, shards).fingerprint()  # as data_fingerprint
    return PackedLoader(stream, seq_len, micro_batch_size, dp_rank, dp_size, sp_rank, sp_size,
                        num_workers, max_epochs, prefetch_factor, pin_memory, fp, skipped)
