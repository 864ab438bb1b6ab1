"""Writes that fail for reasons outside the run: a full disk, no inodes left, a quota, a read-only
mount.

Each ends the run with one :class:`WriteError` (an ``error:`` line from the launcher) that names the
path and the cause (:func:`cause`: the errno text, and for a full disk what is left: bytes and
inodes), never a traceback. A run folder that cannot be written is refused before anything is read
(:func:`check_writable`, on every rank). A failure seen by one rank becomes every rank's error
(:func:`agree`): a rank that raised alone would leave the others waiting in the next collective.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import torch.distributed as dist

from ..errors import HaloUserError

# a full disk, a full inode table, a quota, a file-size limit
FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# one block: creating an empty file succeeds on a full disk, writing one does not
PROBE_BYTES = 4096


class WriteError(HaloUserError, RuntimeError):
    """A file of the run could not be written (disk full, no inodes, quota, read-only, permission);
    the message names the path and the cause, and what was kept."""


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def existing_parent(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (where a missing folder would be created)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def mount_point(path: Path) -> Path:
    """The mount point of the file system holding ``path`` (or where it would be created)."""
    where = existing_parent(path)
    dev = where.stat().st_dev
    while where != where.parent and where.parent.stat().st_dev == dev:
        where = where.parent
    return where


def space_left(path: Path) -> str:
    """``12.3 GiB and 4521 inodes free on /scratch`` (the file system's mount point; inodes only
    where the file system counts them)."""
    try:
        where = mount_point(path)
    except OSError:
        where = existing_parent(path)
    try:
        st = os.statvfs(where)
    except OSError:
        return f"free space on {where} unknown"
    inodes = f" and {st.f_favail} inodes" if st.f_files else ""
    return f"{_human(st.f_bavail * st.f_frsize)}{inodes} free on {where}"


def os_error(exc: BaseException | None) -> OSError | None:
    """``exc`` or the ``OSError`` it was raised while handling (or from), if any."""
    while exc is not None and not isinstance(exc, OSError):
        exc = exc.__cause__ or exc.__context__
    return exc


def cause(exc: OSError, path: Path) -> str:
    """What went wrong, in words: ``No space left on device (0 B and 812 inodes free on /x)``; a
    full inode table is said as such (ENOSPC with bytes left)."""
    text = exc.strerror or str(exc)
    if exc.errno in FULL:
        text += f" ({space_left(path)})"
        try:
            st = os.statvfs(existing_parent(path))
            if exc.errno == errno.ENOSPC and st.f_files and st.f_favail == 0:
                text += ": no inodes left (too many files)"
        except OSError:
            pass
    return text


def check_writable(folder: Path) -> str | None:
    """None if a file can be written where ``folder`` is (in it, or where it would be created);
    else ``cannot write to <folder>: <cause>``. The probe writes and syncs one block and is removed:
    nothing is created in the folder's place."""
    where = existing_parent(folder)
    probe = where / f".write-check-{socket.gethostname()}-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        inside = "" if where == Path(folder).absolute() else f" (in {where})"
        return f"cannot write to {folder}{inside}: {cause(e, where)}"
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
    return None


def agree(error: str | None) -> str | None:
    """Collective (every rank calls it at the same point): the first failing rank's message, or None
    when no rank failed. On one rank: ``error``."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None), None)


def refuse_unwritable(*folders: str | os.PathLike) -> None:
    """Collective, before anything is read: every rank probes ``folders`` (the run folder and the
    checkpoint folder); one that any rank cannot write ends every rank with :class:`WriteError`."""
    problem = next((p for p in (check_writable(Path(f)) for f in folders) if p), None)
    problem = agree(problem)
    if problem is not None:
        raise WriteError(f"{problem}. The run writes its checkpoints, metrics and output there; "
                         "nothing was loaded")


def quiet_tensorboard_thread_errors() -> None:
    """TensorBoard writes events from a thread that re-raises a failed write (a full disk), which
    Python prints as a traceback; the main thread's next ``add``/``flush`` raises the same error,
    reported there (``metrics.MetricsLogger``). So that thread's ``OSError`` is not printed
    twice. Installed once per process."""
    import threading

    previous = threading.excepthook
    if getattr(previous, "quiet_tensorboard", False):
        return

    def hook(args) -> None:
        if not (type(args.thread).__name__ == "_AsyncWriterThread"
                and issubclass(args.exc_type, OSError)):
            previous(args)

    hook.quiet_tensorboard = True
    threading.excepthook = hook
