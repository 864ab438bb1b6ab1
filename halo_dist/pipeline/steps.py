"""How `halo-dist demo` runs its steps: each one a subprocess with its log in ``<out>/logs/``,
skipped when its output exists, stopped gently at the deadline (or on a signal to the demo), some of
them in the background beside the next ones; every step's seconds go to ``timings.json``.

:class:`StepRunner` is that machinery; ``demo.Demo`` adds what the pipeline runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

from .progress import ProgressLine
from ..train.progress_line import format_duration

REPO = Path(__file__).resolve().parents[2]


class DemoStepError(RuntimeError):
    """A pipeline step failed; the message names the step and its log file."""


class DemoPaused(RuntimeError):
    """The deadline came: what finished is kept, running the same command again continues."""


class StepRunner:
    """Runs the demo's steps for the settings ``s`` (``out``, ``deadline_s``, ``device``,
    ``pause_after``). ``limits``: ``(stage_min_s, other_min_s, stop_grace_s)``: a stage is not
    started with less than ``stage_min_s`` left before the deadline, another step with less than
    ``other_min_s``; a stopped step gets ``stop_grace_s`` before SIGKILL."""

    def __init__(self, s, limits: tuple[float, float, float]):
        self.s = s
        self.out = Path(s.out).resolve()
        self.logs = self.out / "logs"
        self.timings: dict[str, float] = {}
        self.deadline = time.time() + s.deadline_s if s.deadline_s > 0 else None
        self.stop_signal: int | None = None
        self.background: dict[str, tuple[subprocess.Popen, Path, float]] = {}
        self.background_ended: dict[str, float] = {}  # when a background step's process exited
        self.stage_min_s, self.other_min_s, self.stop_grace_s = limits

    def run(self, name: str, cmd: list[str], done: Path, stage: bool = False) -> None:
        """Run one step unless ``done`` exists; its output goes to logs/<name>.log (appended over
        pieces).

        ``stage``: a training launcher, which checkpoints and exits 0 on SIGTERM, so the deadline
        stops it gently; any other step is simply stopped there and redone by the next piece."""
        self.run_together([(name, cmd, done)], stage=stage)

    def run_together(self, steps: list[tuple[str, list[str], Path]], stage: bool = False) -> None:
        """Run independent steps at the same time (e.g. teacher and student evaluations, which leave
        a GPU mostly idle one at a time); each is skipped when its ``done`` file exists."""
        todo = []
        for name, cmd, done in steps:
            if done.exists():
                print(f"[demo] {name:<16} already done ({done.relative_to(self.out)})", flush=True)
            else:
                todo.append((name, cmd))
        if not todo:
            return
        names = " + ".join(name for name, _ in todo)
        left = self.time_left()
        if left is not None and left < (self.stage_min_s if stage else self.other_min_s):
            raise DemoPaused(f"{left:.0f}s left before the deadline: {names} not started")
        self.logs.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        logs = ", ".join(str((self.logs / f"{name}.log").relative_to(self.out)) for name, _ in todo)
        print(f"[demo] {names:<16} running (log {logs})", flush=True)
        threads = self.cpu_threads(len(todo))
        running = [(name, self._start(name, cmd, threads)) for name, cmd in todo]
        done_of = {name: done for name, _, done in steps}
        line = ProgressLine(f"[demo] {names:<16} ")
        results = []
        for name, (proc, log) in running:
            rc, stopped = self._wait(proc, lambda: line.show(self.status([n for n, _ in todo],
                                                                         t0)))
            # a step that wrote its done file and exited 0 as the deadline's SIGTERM came has
            # finished
            results.append((name, rc, stopped and not (rc == 0 and done_of[name].exists()), log))
        line.end()
        self.record_time(names, time.time() - t0)  # wall time: steps run together are counted once
        if any(stopped for _, _, stopped, _ in results):
            print(f"[demo] {names:<16} paused", flush=True)
            saved = (" (checkpoint saved)" if stage and all(rc == 0 for _, rc, _, _ in results)
                     else "")
            cause = f"signal {self.stop_signal}" if self.stop_signal else "the deadline"
            raise DemoPaused(f"{cause} stopped {names}{saved}")
        failed = [(name, rc, log) for name, rc, _, log in results if rc != 0]
        if failed:
            print(f"[demo] {names:<16} FAILED", flush=True)
            raise _step_failed(*failed[0])
        print(f"[demo] {names:<16} done in {time.time() - t0:.0f}s", flush=True)
        if self.s.pause_after and self.s.pause_after in {name for name, _ in todo}:
            # a background step still running finishes first (until the deadline): stopped here, it
            # would start over in the next piece and share the GPU with that piece's stage
            self.join_background()
            raise DemoPaused(f"paused after {self.s.pause_after} (--pause-after)")

    def start_background(self, name: str, cmd: list[str], done: Path) -> None:
        """Start a step that needs nothing the next steps make, to run alongside them (unless
        ``done`` exists). ``join_background`` waits for it; at the deadline it is stopped with the
        foreground step and started again by the next piece (the evaluation suite keeps its finished
        parts)."""
        if done.exists():
            print(f"[demo] {name:<16} already done ({done.relative_to(self.out)})", flush=True)
            return
        self.logs.mkdir(parents=True, exist_ok=True)
        # itself and the foreground step beside it
        proc, log = self._start(name, cmd, self.cpu_threads(2))
        self.background[name] = (proc, log, time.time())
        print(f"[demo] {name:<16} started alongside the next steps (log "
              f"{log.relative_to(self.out)})", flush=True)

    def join_background(self) -> None:
        """Wait for the background steps; a failed one stops the demo with its log's tail."""
        for name in list(self.background):
            proc, log, t0 = self.background[name]
            print(f"[demo] {name:<16} waiting ...", end="", flush=True)
            rc, stopped = self._wait(proc)
            self._end_background(name)
            if stopped:
                print(" paused", flush=True)
                raise DemoPaused(f"the deadline stopped {name}")
            if rc != 0:
                print(" FAILED", flush=True)
                raise _step_failed(name, rc, log)
            print(f" done ({time.time() - t0:.0f}s since it started)", flush=True)

    def stop_background(self) -> None:
        """SIGTERM whatever still runs in the background (the demo is pausing or failing), SIGKILL
        after the grace."""
        for name in list(self.background):
            proc = self.background[name][0]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=self.stop_grace_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            self._end_background(name)

    def _note_background_exits(self) -> None:
        """Note when a background step exits (checked every second while a foreground step runs), so
        its window ends there and not when the demo next looks at it."""
        for name, (proc, _, _) in self.background.items():
            if name not in self.background_ended and proc.poll() is not None:
                self.background_ended[name] = time.time()

    def _end_background(self, name: str) -> None:
        """Forget the step; its seconds go to ``timings.json`` and its time window to
        ``background.json`` (which stage intervals shared the GPU with it)."""
        _, _, t0 = self.background.pop(name)
        t1 = self.background_ended.pop(name, time.time())
        self.record_time(f"{name} (background)", t1 - t0)
        path = self.out / "background.json"
        windows = json.loads(path.read_text()) if path.exists() else []
        windows.append({"name": name, "start": t0, "end": t1})
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(windows, indent=2))
        os.replace(tmp, path)

    def _start(self, name: str, cmd: list[str],
               threads: int | None = None) -> tuple[subprocess.Popen, Path]:
        log = self.logs / f"{name}.log"
        with open(log, "a") as f:
            f.write("$ " + " ".join(cmd) + (f"  # OMP_NUM_THREADS={threads}" if threads else "")
                    + "\n")
            f.flush()
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                    env=_env(threads), start_new_session=True)
        return proc, log

    def cpu_threads(self, starting: int) -> int | None:
        """CPU threads for each of ``starting`` steps about to start beside the background steps
        still running, on a CPU-only demo (None on a GPU: the settings' device is not "cpu"): they
        share OMP_NUM_THREADS (else the core count). OpenMP threads that outnumber the cores spin
        against each other: on 2 cores, each with 2 threads, the teacher's NIAH ran ~50x slower
        beside stage 1 than alone."""
        if self.s.device != "cpu":
            return None
        live = sum(proc.poll() is None for proc, _, _ in self.background.values())
        budget = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
        return max(1, budget // (starting + live))

    def status(self, names: list[str], t0: float) -> str:
        """The progress line of the steps ``names`` started at ``t0`` (``demo.Demo`` shows a
        stage's step, loss and ETA)."""
        return f"running for {format_duration(time.time() - t0)}"

    def _wait(self, proc: subprocess.Popen,
              tick: Callable[[], None] = lambda: None) -> tuple[int, bool]:
        """Wait for the step, calling ``tick`` about every second (the progress line); at the
        deadline (or a signal to the demo) SIGTERM it, then SIGKILL after the grace.

        SIGTERM goes to the step's own process only: a stage's loader workers must live until it has
        saved its checkpoint. Returns ``(exit code, stopped early)``."""
        while True:
            try:
                return proc.wait(timeout=1.0), False
            except subprocess.TimeoutExpired:
                tick()
                self._note_background_exits()
                left = self.time_left()
                if left is None or left > 0:
                    continue
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(timeout=self.stop_grace_s), True
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                return proc.wait(), True

    def time_left(self) -> float | None:
        if self.stop_signal is not None:
            return 0.0
        return None if self.deadline is None else self.deadline - time.time()

    def record_time(self, name: str, seconds: float) -> None:
        """Add a step's seconds to ``timings.json`` (totals over every piece of the run)."""
        self.timings[name] = self.timings.get(name, 0.0) + seconds
        path = self.out / "timings.json"
        saved = json.loads(path.read_text()) if path.exists() else {}
        saved[name] = saved.get(name, 0.0) + seconds
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(saved, indent=2))
        os.replace(tmp, path)


def _step_failed(name: str, rc: int, log: Path) -> DemoStepError:
    tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
    return DemoStepError(f"step {name} failed (exit {rc}); log: {log}\n{tail}")


def _env(threads: int | None = None) -> dict:
    """A step's environment: this repository importable, OMP_NUM_THREADS = ``threads`` when given
    (else the user's, else the core count), no tokenizer thread pools beside our processes."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2))))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = f"{REPO}:{env.get('PYTHONPATH', '')}"
    return env
