"""One rank's failure ends every rank, with that rank's message printed on each.

Without this, an error on one rank is a silent hang: the failing rank waits in a collective the
others never reach (a barrier on its way out), while they wait in one it left (DeepSpeed's
``load_checkpoint``, a step's all-reduce), until the process group's timeout, and no output says
why. torchrun ends the other ranks once a rank *exits*; srun without torchrun, or a rank stuck in
NCCL, does not.

So every rank of a multi-rank run keeps a :class:`FailureWatch`:

* A rank whose run raises posts its error to the job's rendezvous store (the TCPStore that every
  torch.distributed job has at ``MASTER_ADDR:MASTER_PORT``: rank 0's, or torchrun's agent's) before
  it joins anything collective again, waits until every rank has read it (at most
  :data:`GRACE_S`), and exits with its own error. The first error posted is the one reported.
* A watchdog thread on every rank checks that key every :data:`POLL_S` (one small request per
  rank and second, on a store connection of its own, so that it never queues behind the process
  group's requests). When another rank's error appears, it prints
  ``error: rank N failed (on HOST), so rank M stops too: <its message>`` and ends this process,
  wherever its main thread is blocked; the exit status is the failing rank's (2 for a user error,
  1 for a bug).
* A rank whose own error is only the echo of another's (a collective that broke because that
  rank left: a :class:`torch.distributed.DistError`) reports the other rank's error instead; any
  other error of its own is kept, after a line naming the rank that failed first.

A rank killed outright (SIGKILL, a node failure) posts nothing: its peers' collectives then fail
(gloo: at once, the connection closes) or time out (the process group's timeout,
``deepspeed_setup.init_distributed``); a store unreachable for :data:`LOST_S` (its host died) ends
the watchdog's rank too.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from ..errors import HaloUserError

POLL_S = 1.0
GRACE_S = 10.0  # the longest a failing rank waits for the others to read its error
LOST_S = 30.0  # the store unreachable this long: its host (rank 0 or torchrun's agent) is gone
STORE_TIMEOUT = timedelta(seconds=10)
USER_ERROR, BUG = 2, 1  # exit statuses, as the launchers use them


class RankFailure(HaloUserError):
    """Another rank failed first; this rank stops with that rank's message and exit status."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def _key() -> str:
    """One key per job attempt: torchrun's agent keeps its store across restarts of the workers."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"halo_dist/failure/{run}/{attempt}"


def describe(error: BaseException) -> tuple[int, str]:
    """``(exit status, one-line summary)`` of a rank's error."""
    if isinstance(error, HaloUserError):
        return getattr(error, "exit_code", USER_ERROR), str(error)
    text = str(error).strip().splitlines()
    return BUG, f"{type(error).__name__}: {text[0] if text else ''}"[:2000]


class FailureWatch:
    """The failure board and watchdog of one rank (module doc). ``start()`` it once the process
    group exists, :meth:`report` an error of this rank, :meth:`stop` it when the run is over."""

    def __init__(self, rank: int, world: int, on_abort: Callable[[], None] | None = None):
        self.rank, self.world = rank, world
        self.on_abort = on_abort or (lambda: None)
        self.key = _key()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.store = None
        if world > 1:
            self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                       is_master=False, timeout=STORE_TIMEOUT)

    def start(self) -> "FailureWatch":
        if self.store is not None:
            self._thread = threading.Thread(target=self._watch, name="halo-failure-watch",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=STORE_TIMEOUT.total_seconds())

    def report(self, error: BaseException) -> BaseException:
        """This rank's run raised ``error``: post it, wait for the others to read it, and return the
        error to raise (``error`` itself, or a :class:`RankFailure` when ``error`` only echoes
        another rank's failure)."""
        self._stopped.set()  # from here on this rank reports, its watchdog stands down
        if self.store is None:
            return error
        code, summary = describe(error)
        mine = f"{code}|{self.rank}|{socket.gethostname()}|{summary}"
        try:
            first = self.store.compare_set(self.key, "", mine).decode()
            self.store.add(self.key + "/seen", 1)
            self._wait_until_read()
        except (dist.DistError, RuntimeError):
            return error  # the store is gone with its host: nothing to tell or to learn
        if first == mine:
            return error
        other_code, other_summary, message = self._read(first)
        if isinstance(error, dist.DistError):
            return RankFailure(message, other_code)
        if other_summary != summary:
            print(f"error: {message}", file=sys.stderr, flush=True)
        return error

    def _read(self, posted: str) -> tuple[int, str, str]:
        """``(exit status, summary, the line this rank prints)`` of another rank's posted error."""
        code, rank, host, summary = posted.split("|", 3)
        return int(code), summary, (f"rank {rank} failed (on {host}), so rank {self.rank} stops "
                                    f"too: {summary}")

    def _wait_until_read(self) -> None:
        deadline = time.monotonic() + GRACE_S
        while self.store.add(self.key + "/seen", 0) < self.world and time.monotonic() < deadline:
            time.sleep(0.2)

    def _watch(self) -> None:
        unreachable_since = None
        while not self._stopped.wait(POLL_S):
            try:
                failed = self.store.check([self.key])
                if failed:
                    first = self.store.get(self.key).decode()
                    self.store.add(self.key + "/seen", 1)
                unreachable_since = None
            except (dist.DistError, RuntimeError) as e:
                # the store's host left at the end of a run (stop() follows within moments), a
                # request was slow, or the host died: only a store gone for LOST_S ends this rank
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since > LOST_S and not self._stopped.is_set():
                    self._abort(BUG, f"rank {self.rank} lost the job's rendezvous store at "
                                     f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
                                     f"({type(e).__name__}): rank 0 or the launcher is gone")
                continue
            if failed and not self._stopped.is_set():
                code, _, message = self._read(first)
                self._abort(code, message)
                return

    def _abort(self, code: int, message: str) -> None:
        """End this process from the watchdog thread: the main thread may be inside a collective
        that will never complete, where no exception can reach it."""
        print(f"error: {message}", file=sys.stderr, flush=True)
        try:
            self.on_abort()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
