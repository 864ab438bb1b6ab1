"""A checkpoint's files: written and recorded at save, checked at resume.

At save every rank writes its files through :class:`RecordedWrites` (DeepSpeed's shards too, through
its checkpoint engine): each file is written through a Python file object, so a full disk raises an
``OSError`` with its errno (torch's own path writer turns it into ``RuntimeError('unexpected
pos')``), then synced to disk and recorded with its size and content hash. A failed write is
recorded instead of raised: the rank still goes through DeepSpeed's remaining barriers with the
others, and the ranks agree on the failure afterwards (``checkpoint.CheckpointManager.save``).
Rank 0 writes the list of every rank's files (the manifest) into the ``COMPLETE`` marker, the last
file written.

At resume (:func:`verify`) every file of the manifest must be present with its size and hash; the
ranks share the hashing (file i on rank i mod world) and agree on the verdict. The hash is xxHash's
XXH3-128: it detects truncation and damage, not tampering (checkpoint files are loaded weights-only
for that, ``parallel/safe_load.py``). Streamed from the page cache it costs 0.10 s per GiB on one
CPU core, barely more than reading the file (0.08 s; sha256 0.77 s;
``bench/bench_checkpoint_hash.py`` on the 2-core CPU VM), so a save reads back what it wrote at
little cost and a resume is bound by the disk.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

MARKER = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
HASH = "xxh3_128"
CHUNK = 8 << 20


def rank_file(path: Path, rank: int) -> Path:
    """A checkpoint's file of one rank's RNG states (and the trainer's ``rank_state``)."""
    return path / f"rng_rank{rank:05d}.pt"


def file_hash(path: Path) -> str:
    """XXH3-128 of the file's bytes, read in 8 MiB chunks."""
    import xxhash

    h = xxhash.xxh3_128()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (files created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _GuardedCheckpointEngine:
    """DeepSpeed's checkpoint engine during one save: its writes go through
    :meth:`RecordedWrites.torch_save`; everything else is the engine's."""

    def __init__(self, inner, writes: "RecordedWrites"):
        self._inner, self._writes = inner, writes

    def save(self, state_dict, path: str) -> None:
        self._writes.torch_save(state_dict, Path(path),
                                zipfile=getattr(self._inner, "zipfile_serialization", True))

    def __getattr__(self, name):
        return getattr(self._inner, name)


class RecordedWrites:
    """One rank's files of one save (module doc): ``entries`` maps each file's path relative to the
    checkpoint folder to its size, hash and rank; ``error`` is the first failed write (``path:
    cause``), after which this rank writes nothing more."""

    def __init__(self, folder: Path, rank: int):
        self.folder, self.rank = folder, rank
        self.entries: dict[str, dict] = {}
        self.error: str | None = None

    def _write(self, path: Path, write) -> None:
        from .disk import cause, os_error

        if self.error is not None:
            return
        try:
            with open(path, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            self.record(path)
        except (OSError, RuntimeError) as e:
            # torch's zip writer, failing mid-file, raises RuntimeError('unexpected pos') while the
            # file's OSError propagates: that one says why
            if os_error(e) is None:
                raise
            self.error = f"{path}: {cause(os_error(e), path)}"

    def record(self, path: Path) -> None:
        self.entries[path.relative_to(self.folder).as_posix()] = {
            "size": path.stat().st_size, HASH: file_hash(path), "rank": self.rank}

    def torch_save(self, obj, path: Path, zipfile: bool = True) -> None:
        self._write(path, lambda f: torch.save(obj, f, _use_new_zipfile_serialization=zipfile))

    def text(self, path: Path, text: str) -> None:
        self._write(path, lambda f: f.write(text.encode()))

    def deepspeed_save(self, engine, root: Path) -> None:
        """``engine.save_checkpoint`` into this folder (tag = its name), every file written here;
        rank 0's copy of DeepSpeed's recovery scripts (``zero_to_fp32.py``, into the checkpoints
        root, outside the checkpoint engine) is guarded alike."""
        inner, copy = engine.checkpoint_engine, engine._copy_recovery_script

        def guarded_copy(save_path):
            self._guard(lambda: copy(save_path), Path(save_path) / "zero_to_fp32.py")

        engine.checkpoint_engine = _GuardedCheckpointEngine(inner, self)
        engine._copy_recovery_script = guarded_copy  # shadows the method for this save only
        try:
            self._guard(lambda: engine.save_checkpoint(str(root), tag=self.folder.name,
                                                       save_latest=False), self.folder)
        finally:
            engine.checkpoint_engine = inner
            del engine._copy_recovery_script

    def _guard(self, fn, path: Path) -> None:
        from .disk import cause

        if self.error is not None:
            return
        try:
            fn()
        except OSError as e:
            self.error = f"{e.filename or path}: {cause(e, path)}"


def gather_entries(entries: dict[str, dict]) -> dict[str, dict]:
    """Collective: every rank's recorded files, merged."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(entries)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, entries)
    return {name: entry for part in parts for name, entry in part.items()}


def unrecorded(folder: Path, entries: dict[str, dict], writes: RecordedWrites) -> None:
    """Rank 0, before the marker: record (and sync) the files no rank recorded, those DeepSpeed
    writes into the folder by other means (with NVMe offload, a copy of the offloaded tensors)."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        if name not in entries:
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            writes.record(path)


# ------------------------------------------------------------------------------------------------
# resume: check the files against the manifest
# ------------------------------------------------------------------------------------------------


def read_marker(path: Path) -> dict:
    """The ``COMPLETE`` marker's content; ``{}`` for a marker that is not valid JSON (its folder
    then fails :func:`verify`)."""
    try:
        data = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _check_file(folder: Path, name: str, entry: dict) -> str | None:
    who = f"rank {entry.get('rank', '?')}'s "
    try:
        size = (folder / name).stat().st_size
        if size != entry["size"]:
            return f"{who}{name} has {size} bytes, {entry['size']} when saved"
        if file_hash(folder / name) != entry[HASH]:
            return f"{who}{name} differs from its checksum at save"
    except FileNotFoundError:
        return f"{who}{name} is missing"
    except OSError as e:
        return f"{who}{name} cannot be read ({e.strerror or e})"
    return None


def _legacy_problems(folder: Path) -> list[str]:
    """A checkpoint written before manifests: its per-rank state files and trainer state must
    exist (their content cannot be checked)."""
    try:
        world = json.loads((folder / TRAINER_STATE).read_text())["world_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return [f"{TRAINER_STATE} is missing or unreadable"]
    return [f"rank {r}'s {rank_file(folder, r).name} is missing" for r in range(world)
            if not rank_file(folder, r).exists()]


def verify(folder: Path, rank: int = 0, world: int = 1) -> list[str]:
    """What is wrong with checkpoint ``folder`` (empty: it verifies). Collective when ``world`` >
    1: every rank calls it with the same folder and gets the same answer."""
    marker = read_marker(folder)
    files = marker.get("files")
    if files is not None:
        names = sorted(files)[rank::world]
        problems = [p for p in (_check_file(folder, n, files[n]) for n in names) if p]
    elif rank != 0:  # what concerns the whole folder, rank 0 says
        problems = []
    else:
        problems = _legacy_problems(folder) if marker else ["its COMPLETE marker is unreadable"]
    if world > 1 and dist.is_initialized():
        parts: list = [None] * world
        dist.all_gather_object(parts, problems)
        problems = [p for part in parts for p in part]
    return problems


def has_manifest(folder: Path) -> bool:
    return "files" in read_marker(folder)
