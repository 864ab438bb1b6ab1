"""The training shards, checked before any model is built: a bad input stops every rank with a
message that names it, instead of an error inside the first step (``Trainer._check_data``)."""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from .evaluation import HeldoutEval


def check_training_data(cfg, rank: int, world: int) -> None:
    """``data.train`` can be read, the held-out split exists, every shard fits the manifest and the
    model's vocabulary and (``data.verify=full``) is intact; collective (every rank calls it)."""
    check_train_source(cfg.data.train)
    HeldoutEval.check_config(cfg)
    check_data_vocabulary(cfg, rank, world)
    verify_data(cfg, rank, world)


def check_train_source(data) -> None:
    """``data.train`` names shards this run can read, checked first: the held-out split and the
    vocabulary checks read it too, and their messages would blame themselves for its mistake."""
    from ..data import resolve_shards
    from ..data.errors import DataError

    hint = ("make shards with `python -m data_prep.tokenize --out DIR ...` (see README, \"Data\") "
            "and set data.train=DIR")
    glob = any(c in str(data) for c in "*?[")
    if isinstance(data, (str, Path)) and not glob and not Path(data).exists():
        raise DataError(f"data.train={data} does not exist; {hint}")
    try:
        resolve_shards(data, "train")
    except (DataError, OSError) as e:
        raise DataError(f"data.train={data} cannot be read ({e}); {hint}") from None


def _sources(cfg) -> list[tuple[object, str]]:
    """The shards a run reads: the training split, and the held-out one when it evaluates."""
    sources = [(cfg.data.train, "train")]
    if cfg.eval.every_steps:
        sources.append((cfg.data.eval or cfg.data.train, cfg.eval.split))
    return sources


def _everyone(bad: list[str], world: int) -> list[str]:
    """The messages of every rank, in rank order (one rank: no process group needed)."""
    if world == 1:
        return bad
    everyone: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(everyone, bad)
    return [msg for rank_bad in everyone for msg in rank_bad]


def _listing(bad: list[str]) -> str:
    more = f" (and {len(bad) - 1} more: {'; '.join(bad[1:4])})" if len(bad) > 1 else ""
    return f"{bad[0]}{more}"


def verify_data(cfg, rank: int, world: int) -> None:
    """``data.verify=full``: every rank fully checks its share of the training shards (and of the
    held-out ones); a bad shard anywhere stops every rank with its name."""
    if cfg.data.verify != "full":
        return
    from ..data import verify_share
    from ..data.errors import DataError

    t0 = time.time()
    bad = _everyone([msg for data, split in _sources(cfg)
                     for msg in verify_share(data, split, rank, world)], world)
    if bad:
        raise DataError(f"data.verify=full found {len(bad)} bad shard(s): {_listing(bad)}; "
                        "re-create them, or drop them from the manifest")
    if rank == 0:
        print(f"data: shards verified (sizes, counts, sha256) in {time.time() - t0:.1f}s over "
              f"{world} rank(s)", flush=True)


def check_data_vocabulary(cfg, rank: int, world: int) -> None:
    """Refuse shards the model cannot train on, before anything is built (otherwise an IndexError
    in the embedding at step 1, or silently another tokenizer's tokens): the manifest's tokenizer
    size against the model's vocabulary, then every shard (the ranks split them) against the
    manifest's dtype and tokenizer and its largest token id against the vocabulary. A shard's
    header (data/shards.py) holds all three, so this reads about a kilobyte per shard; a shard
    without one (another tool's, an older data_prep's) has its tokens scanned once."""
    from ..data import check_share_fits
    from ..data.errors import DataError
    from ..teacher import model_vocab_size

    vocab = model_vocab_size(cfg)
    if vocab is not None:
        _check_manifest_vocabulary(cfg.data.train, vocab)
    bad = _everyone([msg for data, split in _sources(cfg)
                     for msg in check_share_fits(data, split, vocab, rank, world)], world)
    if bad:
        raise DataError(f"{len(bad)} shard(s) do not fit this run: {_listing(bad)}; tokenize "
                        "the data with the teacher's tokenizer, or drop those shards")


def _check_manifest_vocabulary(source, vocab: int) -> None:
    """The manifest's tokenizer is no larger than the model's vocabulary (bare shards: nothing to
    compare)."""
    from ..data import load_manifest
    from ..data.errors import DataError

    source = Path(str(source))
    if not (source.suffix == ".json" or source.is_dir()):
        return
    manifest = load_manifest(source, "train")
    size = (manifest.tokenizer or {}).get("vocab_size")
    if size is not None and int(size) > vocab:
        raise DataError(f"the shards were tokenized with a {int(size):,}-token vocabulary, but "
                        f"the model embeds only {vocab:,} (ids >= {vocab:,} would fail at step "
                        "1): tokenize with the teacher's tokenizer or fix the model's vocab_size",
                        manifest.path, "tokenizer.vocab_size")
