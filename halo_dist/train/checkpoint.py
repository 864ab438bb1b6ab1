"""Checkpoints: ``<dir>/step-00000120/`` folders, valid only once ``COMPLETE`` exists.

A save is collective and leaves every existing checkpoint alone until the new one is complete:

1. rank 0 removes what interrupted saves left (``incomplete-*``, ``replaced-*`` folders) and creates
   ``<dir>/incomplete-step-00000120/``; every rank checks its free space; the ranks agree.
2. Every rank writes there: DeepSpeed's model and optimizer shards and its RNG file (with the
   trainer's ``rank_state``); rank 0 the trainer state and the resolved config. Each file is synced
   and recorded with its size and hash (``checkpoint_files``). A failed write (a full disk, no
   inodes left, a read-only mount) is agreed on by all ranks; the folder is removed and one
   :class:`CheckpointWriteError` names the file and the cause.
3. Rank 0 writes ``COMPLETE`` holding every rank's files (the manifest), syncs, and renames the
   folder to ``step-00000120``. An existing folder of that step (one the resume skipped as damaged)
   is moved aside first and deleted after. Only then are old checkpoints pruned: the newest
   ``keep_last`` up to the new one are kept, older and incomplete ones deleted; a checkpoint newer
   than the new one (skipped by the resume) stays until its step is saved again.

Saving a step this manager has already saved or resumed is a no-op (a stop signal right after a
periodic save, a finished run started again): the checkpoint on disk is that state.

Resume (:func:`find_resume`), before anything is built: ``checkpoint.resume=auto`` continues from
the newest complete checkpoint that verifies (every rank's files present with their recorded sizes
and hashes), printing each one it skips and why; a folder whose checkpoints all fail is refused
(starting from step 0 there would prune them). ``checkpoint.resume=never`` starts a new run, and so
refuses a folder that already holds checkpoints: a second run's checkpoints among the first's would
be pruned against them, and a later automatic resume would continue whichever is newest. Move them
away or point ``checkpoint.dir`` elsewhere. A per-rank state file of a rank the checkpoint had is
never optional: missing, the checkpoint fails verification.

Resuming on another number of ranks (a requeue onto fewer or more GPUs): ZeRO-1/2/3 optimizer states
are partitioned by rank, so rank 0 first converts the checkpoint with DeepSpeed's
``ds_to_universal`` into ``<dir>/universal/step-N/`` (fp32 weights and Adam moments per parameter),
every rank loads its new partition from there, and the converted copy is deleted. Without ZeRO the
states are not partitioned and load as they are. Loader positions are rank-count independent
(``PackedLoader``). The checkpoint folder is shared by all ranks (each reads rank 0's files at
load).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from ..errors import IncompatibleInputError, MissingInputError
from ..parallel.safe_load import forced_weights_only, safe_load
from .checkpoint_files import (MARKER, TRAINER_STATE, RecordedWrites, fsync_dir, gather_entries,
                               has_manifest, rank_file, unrecorded, verify)
from .disk import WriteError, agree, cause, existing_parent

# <dir>/universal/step-N: a checkpoint re-partitionable to any number of ranks
UNIVERSAL = "universal"
# a save in progress, and a damaged checkpoint of the same step moved aside while it is replaced
INCOMPLETE, REPLACED = "incomplete-", "replaced-"
_STEP = re.compile(r"step-(\d+)")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(path: Path) -> int | None:
    """N for a ``step-N`` folder, else None."""
    found = _STEP.fullmatch(Path(path).name)
    return int(found.group(1)) if found else None


def step_folders(root: str | os.PathLike) -> list[Path]:
    """Every ``step-N`` folder, complete or not, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if step_of(p) is not None and p.is_dir()), key=step_of)


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    return [p for p in step_folders(root) if (p / MARKER).exists()]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    done = complete_checkpoints(root)
    return done[-1] if done else None


class DamagedCheckpointError(IncompatibleInputError):
    """No checkpoint the run could continue from verifies (files missing, truncated or changed)."""


def find_resume(root: str | os.PathLike, mode: str, rank: int = 0, world: int = 1,
                announce: bool = True) -> Path | None:
    """The checkpoint a run continues (module doc): ``mode`` is ``checkpoint.resume``. Collective
    when ``world`` > 1 (the ranks share the hashing); prints (``announce``) the checkpoints it
    skips."""
    done = complete_checkpoints(root)
    if mode == "never":
        if done:
            raise IncompatibleInputError(
                f"checkpoint.resume=never, but {root} holds the checkpoints of an earlier run "
                f"({', '.join(p.name for p in done)}): a new run there would prune them and a "
                "later resume could continue either run. Move them away (or set checkpoint.dir to "
                "another folder), or continue that run with checkpoint.resume=auto")
        return None
    skipped = []
    for path in reversed(done):
        problems = verify(path, rank, world)
        if not problems:
            if announce and not has_manifest(path):
                print(f"note: {path} was saved without a manifest: its files' sizes and "
                      "checksums are not checked", flush=True)
            return path
        skipped.append(f"{path.name}: {'; '.join(problems)}")
        if announce:
            print(f"skipping checkpoint {path}: {'; '.join(problems)}", flush=True)
    if skipped:
        raise DamagedCheckpointError(
            f"no checkpoint in {root} verifies: " + " | ".join(skipped)
            + ". Restore the files, or move the checkpoints away to start the run from step 0")
    return None


def verify_or_refuse(path: Path, rank: int = 0, world: int = 1) -> None:
    """A checkpoint the user named (an OPD rung's snapshot, an export): complete and verified, or
    refused; no fallback. Collective when ``world`` > 1."""
    if not (path / MARKER).exists():
        raise MissingInputError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
    problems = verify(path, rank, world)
    if problems:
        raise DamagedCheckpointError(f"checkpoint {path} is damaged: {'; '.join(problems)}")


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


def remove_leftovers(root: Path) -> None:
    """Folders of saves that were interrupted (a kill, a node failure): never resumed from."""
    for p in root.glob(f"{INCOMPLETE}step-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(f"{REPLACED}step-*"):
        remove_checkpoint(p)


class CheckpointWriteError(WriteError):
    """A checkpoint could not be written (too little space, or the write failed); the previous one
    is intact."""


def load_rank_state(path: Path, rank: int) -> dict | None:
    """This rank's file of checkpoint ``path`` (RNG states and the trainer's ``rank_state``); None
    for a rank the checkpoint did not have (written on fewer ranks: the rank keeps its seeded
    state). A missing file of a rank it had is refused: continuing with fresh RNG streams would
    diverge silently from the run."""
    file = rank_file(path, rank)
    if file.exists():
        return safe_load(file, map_location="cpu")
    saved = json.loads((path / TRAINER_STATE).read_text()).get("world_size")
    if saved is not None and rank >= saved:
        return None
    raise MissingInputError(f"{file} is missing: checkpoint {path} was written on {saved or '?'} "
                            f"rank(s) and holds no RNG state of rank {rank}; restore the file or "
                            "resume an earlier checkpoint (move this one away)")


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
    """Save / find / load / prune checkpoints of one run (module doc)."""

    def __init__(self, root: str | os.PathLike, keep_last: int | None = 2):
        """``keep_last``: complete checkpoints kept (at least 1); None keeps every one."""
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be at least 1 (None keeps all), not {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # checkpoints holding the state this manager saved or resumed: saving them again is a no-op
        self._current: set[Path] = set()

    def save(self, engine, step: int, trainer_state: dict, config_text: str,
             rank_state: dict | None = None) -> Path:
        """Collective save of everything needed to continue exactly at ``step`` (module doc).
        ``engine``: a DeepSpeed engine; ``rank_state``: more of this rank's state (tensors and
        plain values), stored in its RNG file beside the RNG states."""
        path = self.root / step_dir_name(step)
        if path in self._current and (path / MARKER).exists():
            return path
        tmp = self.root / f"{INCOMPLETE}{path.name}"
        need = self._prepare(engine, tmp)
        writes = RecordedWrites(tmp, self.rank)
        writes.deepspeed_save(engine, self.root)
        writes.torch_save({**rng_state(), **(rank_state or {})}, rank_file(tmp, self.rank))
        if self.rank == 0:
            writes.text(tmp / TRAINER_STATE, json.dumps(trainer_state, indent=2))
            writes.text(tmp / "config.yaml", config_text)
        self._fail_if(agree(writes.error), path, tmp, need)
        files = gather_entries(writes.entries)
        committed = self._commit(tmp, path, step, files, writes) if self.rank == 0 else None
        self._fail_if(agree(committed), path, tmp, need)
        if self.rank == 0:
            self._prune(path)
        _barrier()
        self._current.add(path)
        return path

    def _prepare(self, engine, tmp: Path) -> int:
        """Rank 0 clears leftovers and creates ``tmp``; every rank refuses a save that would not
        fit, all together (a lone refusal would hang the others). Returns the expected size."""
        problem = None
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                remove_leftovers(self.root)
                tmp.mkdir()
            except OSError as e:
                problem = f"cannot create {tmp}: {cause(e, tmp)}"
        need = expected_bytes(self.root, engine)
        free = shutil.disk_usage(existing_parent(self.root)).free
        if problem is None and free < need * SPACE_MARGIN:
            problem = (f"not enough space for a checkpoint in {self.root}: it needs about "
                       f"{_gib(need)}, {_gib(free)} free on this rank's disk")
        problem = agree(problem)
        if problem is not None:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointWriteError(problem + self._previous())
        return need

    def _fail_if(self, error: str | None, path: Path, tmp: Path, need: int) -> None:
        """Every rank raises the agreed ``error``; rank 0 removes the partial folder first."""
        if error is None:
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"writing checkpoint {path} failed ({error}); the partial "
                                   f"checkpoint was removed. A checkpoint needs about {_gib(need)} "
                                   f"on {self.root}{self._previous()}")

    def _commit(self, tmp: Path, path: Path, step: int, files: dict, writes) -> str | None:
        """Rank 0: the marker with the manifest, then the folder into place (module doc). Returns
        what failed, or None."""
        aside = self.root / f"{REPLACED}{path.name}"
        try:
            unrecorded(tmp, files, writes)
            files.update(writes.entries)
            _atomic_text(tmp / MARKER, json.dumps({"step": step, "files": files}, indent=1))
            fsync_dir(tmp)
            if path.exists():  # damaged (the resume skipped it) or incomplete: replaced now
                os.rename(path, aside)
            os.rename(tmp, path)
            fsync_dir(self.root)
        except OSError as e:
            if aside.exists() and not path.exists():
                os.rename(aside, path)
            return f"{e.filename or tmp}: {cause(e, tmp)}"
        remove_checkpoint(aside)
        return None

    def _previous(self) -> str:
        latest = latest_checkpoint(self.root)
        return f"; the previous checkpoint {latest} is intact" if latest is not None else ""

    def _prune(self, saved: Path) -> None:
        """After ``saved`` is in place: keep the newest ``keep_last`` complete checkpoints up to it,
        delete older and incomplete ``step-N`` folders; leave newer ones (module doc)."""
        if self.keep_last is None:
            return
        upto = [p for p in step_folders(self.root) if step_of(p) <= step_of(saved)]
        keep = [p for p in upto if (p / MARKER).exists()][-self.keep_last:]
        for p in upto:
            if p not in keep:
                try:
                    remove_checkpoint(p)
                except OSError as e:  # the new checkpoint is in place: say so, go on
                    print(f"warning: could not delete old checkpoint {p}: {cause(e, p)}",
                          flush=True)

    def load(self, engine, path: Path, universal: bool = False) -> dict:
        """Restore engine (model, optimizer, LR scheduler) and this rank's RNG; return the trainer
        state.
        ``universal``: the checkpoint was written on another number of ranks under ZeRO-1/2/3
        (module doc); the engine was built with ``checkpoint.load_universal``."""
        rank_state = load_rank_state(path, self.rank)  # refused before anything is loaded
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
        if rank_state is not None:
            set_rng_state(rank_state)
        self._current.add(path)
        return json.loads((path / TRAINER_STATE).read_text())


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
