"""Checkpoints: ``<dir>/step-00000120/`` folders, valid only once ``COMPLETE`` exists.

A save is collective: DeepSpeed writes model + optimizer shards (every rank), each rank writes its
RNG state, rank 0 writes the trainer state (step, tokens, loader position, schedule) and the
resolved config, and after a barrier rank 0 writes the ``COMPLETE`` marker atomically. A crash in
between leaves a folder without the marker, which resume ignores and the next save deletes. The
last ``keep_last`` complete checkpoints are kept. The teacher is never part of a checkpoint.

Resuming on another number of ranks (a requeue onto fewer or more GPUs): ZeRO-1/2/3 optimizer states
are partitioned by rank, so rank 0 first converts the checkpoint with DeepSpeed's
``ds_to_universal`` into ``<dir>/universal/step-N/`` (fp32 weights and Adam moments per parameter),
every rank loads its new partition from there, and the converted copy is deleted. Without ZeRO the
states are not partitioned and load as they are. Loader positions are rank-count independent
(``PackedLoader``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from ..errors import HaloUserError
from ..parallel.safe_load import forced_weights_only, safe_load

MARKER = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
# <dir>/universal/step-N: a checkpoint re-partitionable to any number of ranks
UNIVERSAL = "universal"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if (p / MARKER).exists()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    done = complete_checkpoints(root)
    return done[-1] if done else None


def rng_state() -> dict:
    """All RNG states as tensors / plain Python values, loadable with ``weights_only=True``."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                  float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    # OPD rank files that nest the RNG states beside generator and curriculum
    state = state.get("rng", state)
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint folder, its ``COMPLETE`` marker first: if the deletion stops part-way (a
    kill, a full disk), what is left is an incomplete folder that resume skips, never one that looks
    complete with files missing."""
    (path / MARKER).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


class CheckpointWriteError(HaloUserError, RuntimeError):
    """A checkpoint could not be written (too little space, or the write failed); the previous one
    is intact."""


# bytes per parameter of a save when there is no earlier checkpoint to measure: bf16 weights (2) +
# fp32 master weights and two Adam moments (12), rounded up for DeepSpeed's bookkeeping
BYTES_PER_PARAM = 16
SPACE_MARGIN = 1.1


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def expected_bytes(root: Path, engine) -> int:
    """What the next save will write: the size of the latest complete checkpoint (same model, same
    optimizer), else an estimate from the parameter count."""
    latest = latest_checkpoint(root)
    if latest is not None:
        return folder_bytes(latest)
    params = sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters())
    return params * BYTES_PER_PARAM


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


class CheckpointManager:
    """Save / find / load / prune checkpoints of one run."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 2):
        self.root = Path(root)
        self.keep_last = keep_last
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def save(self, engine, step: int, trainer_state: dict, config_text: str,
             rank_state: dict | None = None) -> Path:
        """Collective save of everything needed to continue exactly at ``step``. ``engine``: a
        DeepSpeed engine; ``rank_state``: more of this rank's state (tensors and plain values),
        stored in its RNG file beside the RNG states."""
        tag = step_dir_name(step)
        path = self.root / tag
        if self.rank == 0 and path.exists():
            shutil.rmtree(path)  # an incomplete leftover of a crashed save of the same step
        _barrier()
        need = self._check_space(engine)
        try:
            engine.save_checkpoint(str(self.root), tag=tag, save_latest=False)
            torch.save({**rng_state(), **(rank_state or {})}, rank_file(path, self.rank))
            if self.rank == 0:
                _atomic_text(path / TRAINER_STATE, json.dumps(trainer_state, indent=2))
                _atomic_text(path / "config.yaml", config_text)
        except OSError as e:
            # no marker: never resumed from; free what it took
            shutil.rmtree(path, ignore_errors=True)
            raise CheckpointWriteError(f"writing checkpoint {path} failed "
                                       f"({e.strerror or e}); it needs about "
                                       f"{_gib(need)} on {self.root}{self._previous()}") from e
        _barrier()
        if self.rank == 0:
            _atomic_text(path / MARKER, json.dumps({"step": step}))
            self._prune()
        _barrier()
        return path

    def _check_space(self, engine) -> int:
        """Refuse a save that would not fit (before writing anything, on every rank at once);
        returns the expected size in bytes."""
        self.root.mkdir(parents=True, exist_ok=True)
        need = expected_bytes(self.root, engine)
        free = shutil.disk_usage(self.root).free
        short = torch.tensor([1.0 if free < need * SPACE_MARGIN else 0.0])
        # every rank refuses, or none: a lone refusal would hang the others
        if dist.is_initialized():
            short = short.cuda() if dist.get_backend() == "nccl" else short
            dist.all_reduce(short, op=dist.ReduceOp.MAX)
        if short.item() > 0:
            raise CheckpointWriteError("not enough space for a checkpoint in "
                                       f"{self.root}: it needs about {_gib(need)}, "
                                       f"{_gib(free)} free on this rank's disk{self._previous()}")
        return need

    def _previous(self) -> str:
        latest = latest_checkpoint(self.root)
        return f"; the previous checkpoint {latest} is intact" if latest is not None else ""

    def _prune(self) -> None:
        """Keep the newest ``keep_last`` complete checkpoints; drop older and incomplete folders."""
        done = complete_checkpoints(self.root)
        keep = {p.name for p in done[-self.keep_last :]}
        newest = int(done[-1].name.split("-")[1]) if done else -1
        for p in self.root.glob("step-*"):
            n = int(p.name.split("-")[1])
            if p.name not in keep and (p in done or n < newest):
                remove_checkpoint(p)

    def load(self, engine, path: Path, universal: bool = False) -> dict:
        """Restore engine (model, optimizer, LR scheduler) and this rank's RNG; return the trainer
        state.
        ``universal``: the checkpoint was written on another number of ranks under ZeRO-1/2/3
        (module doc); the engine was built with ``checkpoint.load_universal``."""
        source = to_universal(path) if universal else path
        with forced_weights_only(str(source)):
            load_path, _ = engine.load_checkpoint(str(source.parent), tag=source.name,
                                                  load_optimizer_states=True,
                                                  load_lr_scheduler_states=True)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {source}")
        if universal:
            _barrier()
            if self.rank == 0:
                shutil.rmtree(source.parent)  # a converted copy, as large as the checkpoint
        rng_file = rank_file(path, self.rank)
        if rng_file.exists():  # a rank the checkpoint did not have starts from its seeded state
            set_rng_state(safe_load(rng_file, map_location="cpu"))
        return json.loads((path / TRAINER_STATE).read_text())


def rank_file(path: Path, rank: int) -> Path:
    """A checkpoint's file of one rank's RNG states (and the trainer's ``rank_state``)."""
    return path / f"rng_rank{rank:05d}.pt"


def to_universal(path: Path) -> Path:
    """Rank 0 converts checkpoint ``path`` with DeepSpeed's ``ds_to_universal`` (one process, every
    load weights-only) into ``<dir>/universal/<name>``; all ranks return that folder after a
    barrier."""
    out = path.parent / UNIVERSAL / path.name
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        from deepspeed.checkpoint import ds_to_universal

        shutil.rmtree(out.parent, ignore_errors=True)  # a conversion cut short earlier
        args = SimpleNamespace(input_folder=str(path), output_folder=str(out),
                               num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                               strict=True, inject_missing_state=True)
        with forced_weights_only(str(path)):
            ds_to_universal.main(args)
    _barrier()
    return out


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
