"""The training shards, checked before any model is built: a bad input stops every rank with a
message that names it, instead of an error inside the first step (``Trainer._check_data``)."""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from .evaluation import HeldoutEval


def check_training_data(cfg, rank: int, world: int) -> None:
    """The held-out split exists, the shards fit the model's vocabulary and (``data.verify=full``)
    are intact; collective (every rank calls it)."""
    HeldoutEval.check_config(cfg)
    check_data_vocabulary(cfg)
    verify_data(cfg, rank, world)


def verify_data(cfg, rank: int, world: int) -> None:
    """``data.verify=full``: every rank fully checks its share of the training shards (and of the
    held-out ones); a bad shard anywhere stops every rank with its name."""
    if cfg.data.verify != "full":
        return
    from ..data import verify_share
    from ..data.errors import DataError

    t0 = time.time()
    sources = [(cfg.data.train, "train")]
    if cfg.eval.every_steps:
        sources.append((cfg.data.eval or cfg.data.train, cfg.eval.split))
    bad = [msg for data, split in sources for msg in verify_share(data, split, rank, world)]
    everyone: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(everyone, bad)
    bad = [msg for rank_bad in everyone for msg in rank_bad]
    if bad:
        more = f" (and {len(bad) - 1} more: {'; '.join(bad[1:4])})" if len(bad) > 1 else ""
        raise DataError(f"data.verify=full found {len(bad)} bad shard(s): {bad[0]}{more}; "
                        "re-create them, or drop them from the manifest")
    if rank == 0:
        print(f"data: shards verified (sizes, counts, sha256) in {time.time() - t0:.1f}s over "
              f"{world} rank(s)", flush=True)


def check_data_vocabulary(cfg) -> None:
    """Refuse shards whose token ids the model cannot embed (otherwise an IndexError in the
    embedding at step 1). Compares the manifest's tokenizer size with the model's vocabulary; bare
    shards without a manifest carry no size and are not checked here (nor scanned: the loader reads
    them once, later)."""
    from ..data import load_manifest
    from ..data.errors import DataError
    from ..stages.teacher import model_vocab_size

    source = Path(str(cfg.data.train))
    vocab = model_vocab_size(cfg) if source.suffix == ".json" or source.is_dir() else None
    if vocab is None:
        return
    manifest = load_manifest(source, "train")
    size = (manifest.tokenizer or {}).get("vocab_size")
    if size is not None and int(size) > vocab:
        raise DataError(f"the shards were tokenized with a {int(size):,}-token vocabulary, but "
                        f"the model embeds only {vocab:,} (ids >= {vocab:,} would fail at step "
                        "1): tokenize with the teacher's tokenizer or fix the model's vocab_size",
                        manifest.path, "tokenizer.vocab_size")
