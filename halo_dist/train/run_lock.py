"""One run writes to a run folder at a time: ``<folder>/run.lock``.

Two runs on one run dir (a job submitted twice, ``srun -n 2`` without torchrun: two one-rank runs)
would crash each other or both finish while the later one overwrites ``final/``, ``config.yaml`` and
``metrics.jsonl``. So rank 0 takes this lock on the run dir (and on the checkpoint dir when that
lies elsewhere) before anything is written, the other ranks wait for its verdict
(:func:`claim_run_dirs`), and the lock is released (the file removed) when the run ends.

The file is created with ``O_CREAT | O_EXCL`` (atomic on local disks, NFS v3+ and Lustre) and holds
who took it: host, pid, the process's start time (``/proc``, so a pid reused by another process is
told apart), the wall-clock start and the Slurm job. It is also held with ``flock`` where the
filesystem supports it: a live holder on this host (and, on filesystems whose locks are coherent
across nodes, elsewhere) is then seen even if the file's contents were lost. When the file exists:

* ``flock`` says it is held: refused, naming the holder.
* it names a process on this host: taken over (with a message) if that process is gone, refused if
  it runs.
* it names an earlier run of this Slurm job (same job id, lower ``SLURM_RESTART_COUNT``: a requeue,
  which Slurm starts only after the earlier run ended): taken over.
* it names another host: refused, with the advice to remove the file if that job is gone. A pid on
  another host cannot be checked from here, and ``flock`` cannot vouch for it either: Lustre mounted
  with ``localflock`` (or NFS without a lock manager) keeps locks per node, so a free ``flock`` does
  not prove that the other node's run ended.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import HaloUserError

LOCK_NAME = "run.lock"
# flock errors that mean "this filesystem does not lock", not "someone holds it"
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
# a lock file without contents younger than this is one being written by a run that starts now
NEW_LOCK_S = 30.0


class RunDirBusyError(HaloUserError, RuntimeError):
    """Another run holds the run folder's lock."""


@dataclass(frozen=True)
class Holder:
    """What a lock file records about the run that took it."""

    host: str
    pid: int
    started: str  # wall clock, for people
    proc_start: str | None  # /proc/<pid>/stat's start time: tells a reused pid apart
    slurm_job: str | None
    slurm_restart: int

    @classmethod
    def this_process(cls) -> "Holder":
        return cls(host=socket.gethostname(), pid=os.getpid(),
                   started=time.strftime("%Y-%m-%d %H:%M:%S %z"),
                   proc_start=_proc_start(os.getpid()), slurm_job=os.environ.get("SLURM_JOB_ID"),
                   slurm_restart=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))

    def describe(self) -> str:
        job = f", Slurm job {self.slurm_job}" if self.slurm_job else ""
        return f"pid {self.pid} on {self.host}, started {self.started}{job}"


def _proc_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of ``/proc/<pid>/stat``), None
    where there is no ``/proc`` or no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def stale_reason(holder: Holder, me: Holder) -> str | None:
    """Why ``holder``'s run is over (its lock may be taken over), or None if it may still run."""
    if holder.host == me.host:
        if not _alive(holder.pid):
            return f"its process {holder.pid} is gone"
        if holder.proc_start and _proc_start(holder.pid) not in (None, holder.proc_start):
            return f"pid {holder.pid} now belongs to another process"
        return None
    if (holder.slurm_job and holder.slurm_job == me.slurm_job
            and holder.slurm_restart < me.slurm_restart):
        return f"it was run {holder.slurm_restart} of Slurm job {holder.slurm_job}, now requeued"
    return None


def _read_holder(path: Path) -> Holder | None:
    try:
        return Holder(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None  # being written this instant, or not ours: judged by flock alone


def _flock(fd: int) -> bool:
    """Hold ``fd`` with ``flock``: True if held, False where the filesystem does not lock; raises
    BlockingIOError while another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise
    except OSError as e:
        if e.errno in NO_FLOCK:
            return False
        raise
    return True


def _flock_new(fd: int) -> None:
    """``flock`` a file this process just created. A contender may hold it for a moment (it opened
    the file before our contents were written, and will leave it as the lock of a live run)."""
    for _ in range(50):
        try:
            _flock(fd)
            return
        except BlockingIOError:
            time.sleep(0.1)


class RunDirLock:
    """The lock on one folder, held by this process until :meth:`release` (module doc)."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def acquire(cls, folder: str | os.PathLike) -> "RunDirLock":
        """Take ``folder``'s lock (creating the folder), taking over a stale one with a message;
        :class:`RunDirBusyError` while another run holds it."""
        path = Path(folder) / LOCK_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        me = Holder.this_process()
        for _ in range(5):  # each retry follows a removal by us or by the holder
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                cls._take_over_if_stale(path, me)
                continue
            _flock_new(fd)
            os.write(fd, json.dumps(asdict(me)).encode())
            os.fsync(fd)
            return cls(path, fd)
        raise RunDirBusyError(f"could not take the lock {path}: other runs keep taking it")

    @staticmethod
    def _take_over_if_stale(path: Path, me: Holder) -> None:
        """Remove the existing lock file if its run is over; raise if it may still run."""
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return  # released meanwhile
        try:
            try:
                _flock(fd)
            except BlockingIOError:
                raise RunDirBusyError(_busy(path, _read_holder(path), live=True)) from None
            holder = _read_holder(path)
            if holder is not None:
                reason = stale_reason(holder, me)
            else:  # contents not written yet (a run starting this instant), or not a lock of ours
                age = time.time() - os.fstat(fd).st_mtime
                reason = f"it records no run and is {age:.0f}s old" if age > NEW_LOCK_S else None
            if reason is None:
                raise RunDirBusyError(_busy(path, holder, live=False))
            if os.path.exists(path) and os.stat(path).st_ino == os.fstat(fd).st_ino:
                print(f"lock: taking over {path} from {holder.describe() if holder else 'nobody'}"
                      f": {reason}", flush=True)
                os.unlink(path)
        finally:
            os.close(fd)

    def release(self) -> None:
        """Remove the lock file (its run is over). Idempotent."""
        if self.fd is None:
            return
        try:
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        except OSError:
            pass  # a read-only or vanished folder: the stale lock is detected next time
        finally:
            os.close(self.fd)
            self.fd = None


def _busy(path: Path, holder: Holder | None, live: bool) -> str:
    who = holder.describe() if holder is not None else "another process"
    text = f"{path.parent} is in use by another run ({who}; lock file {path})"
    if holder is not None and holder.host != socket.gethostname() and not live:
        return (f"{text}. A process on another host cannot be checked from here: if that run is "
                f"gone (killed, or its node failed), remove {path} and start again; otherwise give "
                "this run another logging.run_dir")
    return f"{text}: wait for it to end, or give this run another logging.run_dir"


class RunLocks:
    """The locks of one run's folders (none on ranks other than 0)."""

    def __init__(self, locks: list[RunDirLock]):
        self.locks = locks

    def release(self) -> None:
        for lock in self.locks:
            lock.release()


def run_folders(cfg) -> list[Path]:
    """The folders a run writes: its run dir, and its checkpoint dir when that lies elsewhere."""
    run_dir = Path(cfg.logging.run_dir).resolve()
    ckpt = Path(cfg.checkpoint_dir).resolve()
    return [run_dir] if ckpt == run_dir or run_dir in ckpt.parents else [run_dir, ckpt]


def claim_run_dirs(cfg, rank: int) -> RunLocks:
    """Rank 0 takes the locks of the run's folders; every rank waits for that verdict before it
    writes anything, and when the run dir is taken every rank raises the same
    :class:`RunDirBusyError`."""
    import torch.distributed as dist

    locks, refusal, folder = [], None, None
    if rank == 0:
        try:
            for folder in run_folders(cfg):
                locks.append(RunDirLock.acquire(folder))
        except RunDirBusyError as e:
            refusal = str(e)
        except OSError as e:  # a folder that cannot be created or written
            refusal = (f"cannot lock the run folder {folder}: {e.strerror or e} (refused before "
                       "anything was loaded or written)")
        if refusal is not None:
            RunLocks(locks).release()
            locks = []
    if dist.is_initialized() and dist.get_world_size() > 1:
        verdict = [refusal]
        dist.broadcast_object_list(verdict, src=0)
        refusal = verdict[0]
    if refusal is not None:
        raise RunDirBusyError(refusal)
    return RunLocks(locks)
