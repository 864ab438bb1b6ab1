"""Faults the tests inject into a training run: a hard crash, a SIGTERM, NaN losses, a file system
that fills up, an error on one rank.

The trainers (``halo_dist.train.trainer.Trainer`` and its subclasses,
``halo_dist.opd.trainer.OPDTrainer`` among them) expose ``step_hooks`` and ``loss_hooks`` lists
that product code leaves empty. A test that builds a trainer itself appends the hooks below; a test
that runs a launcher in a subprocess runs it through this file::

    python tests/fault_injection.py [--crash-at N] [--sigterm-at N] [--nan-at N[,M...]] \\
        [--fill-at N:bytes|inodes:FOLDER] [--fail-at N --fail-rank R] launchers/stage2.py ARGS...

which makes every trainer built in that process (every rank under torchrun) carry the hooks, then
runs the launcher as ``__main__`` with ``ARGS``.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the checkout's halo_dist (as the launchers arrange), and not tests/'s modules
if __name__ == "__main__":
    sys.path[0] = str(REPO)

CRASH_EXIT = 17


def crash_at(step: int):
    """Step hook: exit with 17 right after optimizer step ``step``, like a node failure (no cleanup,
    no checkpoint of that step)."""

    def hook(trainer, done: int) -> None:
        if done == step:
            os._exit(CRASH_EXIT)

    return hook


def sigterm_at(step: int):
    """Step hook: send this process SIGTERM right after optimizer step ``step`` (the trainer's
    handler records it; the ranks agree on it at the end of that step)."""

    def hook(trainer, done: int) -> None:
        if done == step:
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


class InjectedFailure(RuntimeError):
    """The error ``fail_at`` raises: a bug on one rank, as far as the run can tell."""


def fail_at(step: int, rank: int):
    """Step hook: rank ``rank`` alone raises :class:`InjectedFailure` right after optimizer step
    ``step`` (the other ranks go on into the next step's collectives)."""

    def hook(trainer, done: int) -> None:
        if done == step and trainer.rank == rank:
            raise InjectedFailure(f"injected failure on rank {rank} after step {step}")

    return hook


def nan_at(*steps: int):
    """Loss hook: every micro-batch loss of the optimizer steps ``steps`` becomes NaN (the graph is
    kept, so the backward of a skipped step runs as it would on a real NaN)."""
    bad = set(steps)

    def hook(trainer, step: int, loss):
        return loss * float("nan") if step in bad else loss

    return hook


def _fill(what: str, folder: Path) -> None:
    """Write one file until the disk is full (``bytes``), or create empty files until no inode is
    left (``inodes``)."""
    try:
        if what == "bytes":
            with open(folder / "filler-bytes", "wb", buffering=0) as f:
                while True:
                    f.write(b"\0" * (1 << 16))
        for i in range(10**7):
            (folder / f"filler-{i}").touch()
    except OSError:  # full
        pass


def fill_at(step: int, what: str, folder: str):
    """Step hook: right after optimizer step ``step``, fill the file system holding ``folder`` (a
    small tmpfs) with ``folder/filler-*`` files (rank 0; ``what``: ``bytes`` or ``inodes``)."""

    def hook(trainer, done: int) -> None:
        if done == step and trainer.rank == 0:
            _fill(what, Path(folder))

    return hook


def install(step_hooks=(), loss_hooks=()) -> None:
    """Every trainer constructed after this call in this process gets ``step_hooks`` and
    ``loss_hooks``."""
    from halo_dist.train.trainer import Trainer

    init = Trainer.__init__  # every trainer (stages, pretrain, OPD) is a Trainer and runs it

    def hooked_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.step_hooks.extend(step_hooks)
        self.loss_hooks.extend(loss_hooks)

    Trainer.__init__ = hooked_init


def launcher_args(crash_at: int | None = None, sigterm_at: int | None = None,
                  nan_at=None, fill_at: str | None = None,
                  fail_at: tuple[int, int] | None = None) -> list[str]:
    """The options of this script for the given faults (``nan_at``: a step or a list of steps;
    ``fill_at``: ``"N:bytes|inodes:FOLDER"``; ``fail_at``: ``(step, rank)``)."""
    args = ["--fill-at", fill_at] if fill_at else []
    if fail_at is not None:
        args += ["--fail-at", str(fail_at[0]), "--fail-rank", str(fail_at[1])]
    if crash_at is not None:
        args += ["--crash-at", str(crash_at)]
    if sigterm_at is not None:
        args += ["--sigterm-at", str(sigterm_at)]
    if nan_at is not None:
        steps = [nan_at] if isinstance(nan_at, int) else list(nan_at)
        args += ["--nan-at", ",".join(map(str, steps))]
    return args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--crash-at", type=int, help="exit 17 right after this optimizer step")
    parser.add_argument("--sigterm-at", type=int,
                        help="SIGTERM to this process right after this optimizer step")
    parser.add_argument("--nan-at", help="comma-separated optimizer steps whose losses are NaN")
    parser.add_argument("--fill-at", help="N:bytes|inodes:FOLDER: fill FOLDER's file system "
                        "right after optimizer step N")
    parser.add_argument("--fail-at", type=int,
                        help="one rank (--fail-rank) raises right after this optimizer step")
    parser.add_argument("--fail-rank", type=int, default=0, help="the rank that --fail-at fails")
    parser.add_argument("launcher", help="the launcher script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the launcher's arguments")
    a = parser.parse_args(argv)
    step_hooks, loss_hooks = [], []
    if a.crash_at is not None:
        step_hooks.append(crash_at(a.crash_at))
    if a.sigterm_at is not None:
        step_hooks.append(sigterm_at(a.sigterm_at))
    if a.fail_at is not None:
        step_hooks.append(fail_at(a.fail_at, a.fail_rank))
    if a.nan_at:
        loss_hooks.append(nan_at(*(int(s) for s in a.nan_at.split(",") if s.strip())))
    if a.fill_at:
        step, what, folder = a.fill_at.split(":", 2)
        step_hooks.append(fill_at(int(step), what, folder))
    install(step_hooks, loss_hooks)
    sys.argv = [a.launcher, *a.args]
    runpy.run_path(a.launcher, run_name="__main__")


if __name__ == "__main__":
    main()
