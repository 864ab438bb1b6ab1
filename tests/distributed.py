"""Run a function on N CPU ranks (gloo) in spawned processes -- the multi-rank test harness.

    results = run_distributed(fn, world_size=2, args=(...,))   # [result of rank 0, rank 1, ...]

``fn(*args, **kwargs)`` runs on every rank after ``torch.distributed`` is initialised (gloo, short
collective timeout; ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*`` set as torchrun would, and
``OMP_NUM_THREADS=1``). ``fn`` must be importable (defined at module top level). Start-up is
dominated by imports (~1.5 s per spawn for torch), so let one spawn run several scenarios and
return their results, e.g. a dict per scenario; results travel back pickled (tensors by value).
If any rank raises, :class:`DistributedTestError` carries every failing rank's traceback; ranks
still blocked in collectives are terminated after a short grace period.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist


class DistributedTestError(RuntimeError):
    """One or more ranks raised, or the run timed out."""

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures  # rank -> traceback text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """Temporarily set environment variables (spawned children inherit them at start)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _worker(rank, world_size, fn, args, kwargs, results, collective_timeout, init):
    """Child entry point: env -> process group -> fn -> (rank, ok, pickled result | traceback)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        if init:
            dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=collective_timeout))
        payload = (rank, True, pickle.dumps(fn(*args, **kwargs)))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        payload = (rank, False, traceback.format_exc())
    results.put(payload)
    if init and dist.is_initialized() and payload[1]:
        dist.destroy_process_group()


def _collect(procs, results, world_size, timeout, grace):
    """Gather (rank -> outcome); stop waiting `grace` s after the first failure."""
    outcomes, deadline = {}, time.monotonic() + timeout
    while len(outcomes) < world_size and time.monotonic() < deadline:
        try:
            rank, ok, data = results.get(timeout=0.2)
            outcomes[rank] = (ok, data)
            if not ok:
                deadline = min(deadline, time.monotonic() + grace)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead and results.empty():
                deadline = min(deadline, time.monotonic() + grace)
    return outcomes


def _stop(procs, reported):
    """Let ranks that reported exit on their own; terminate the rest (hung or blocked) at once."""
    for rank, p in enumerate(procs):
        if rank in reported:
            p.join(timeout=10)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()


def run_distributed(fn: Callable[..., Any], world_size: int = 2, args: tuple = (),
                    kwargs: Optional[dict] = None, timeout: float = 120.0,
                    collective_timeout: float = 30.0, grace: float = 5.0,
                    init: bool = True, env: Optional[dict[str, str]] = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned gloo ranks; return results by rank.

    Args:
        timeout: wall-clock limit for the whole run (seconds).
        collective_timeout: gloo timeout for each collective, so a rank left waiting errors out.
        grace: seconds to wait for the other ranks after one fails before terminating them.
        init: initialise the default process group before calling ``fn``.
        env: extra environment variables for the children (e.g. ``DS_ACCELERATOR``).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                 "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                 "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
    procs = []
    with _environ(child_env):
        for rank in range(world_size):
            p = ctx.Process(target=_worker,
                            args=(rank, world_size, fn, args, kwargs or {}, results,
                                  collective_timeout, init))
            p.start()
            procs.append(p)
    outcomes = {}
    try:
        outcomes = _collect(procs, results, world_size, timeout, grace)
    finally:
        _stop(procs, outcomes)
    return _unpack(outcomes, world_size, fn)


def _unpack(outcomes, world_size, fn):
    failures = {r: data for r, (ok, data) in outcomes.items() if not ok}
    missing = [r for r in range(world_size) if r not in outcomes]
    if failures or missing:
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())]
        if missing:
            parts.append(f"ranks {missing} did not report (timeout, crash or terminated after "
                         "another rank failed)")
        raise DistributedTestError(f"{getattr(fn, '__name__', fn)} failed on {world_size} ranks:\n"
                                   + "\n".join(parts), failures)
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]
