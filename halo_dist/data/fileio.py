"""Atomic file writes: tmp file in the same folder + fsync + rename (+ fsync of the folder).

A crash or error at any point leaves either the old file or the complete new file under the final
name, never a half-written one.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Callable, Iterator, BinaryIO

TMP_MARK = ".tmp-"


def tmp_path_for(path: Path) -> Path:
    """Hidden temporary sibling of ``path`` (same filesystem, so rename is atomic)."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


def fsync_dir(folder: Path) -> None:
    """fsync a directory so a rename inside it is durable (no-op where unsupported)."""
    try:
        fd = os.open(str(folder), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Open a binary tmp file that replaces ``path`` only if the ``with`` block succeeds."""
    path = Path(path)
    tmp = tmp_path_for(path)
    f = open(tmp, "wb")
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        f.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_open(path) as f:
        f.write(data)


def atomic_write_json(path: str | os.PathLike, obj: object) -> None:
    """Write ``obj`` as indented, key-sorted JSON atomically (deterministic bytes)."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def remove_stale_tmp(folder: Path,
                     is_ours: Callable[[str], bool] = lambda name: True) -> list[Path]:
    """Delete leftover tmp files of earlier crashed runs in ``folder``; returns what was removed."""
    removed = []
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        if p.name.startswith(".") and TMP_MARK in p.name and is_ours(p.name):
            with contextlib.suppress(OSError):
                p.unlink()
                removed.append(p)
    return removed
