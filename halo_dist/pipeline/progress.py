"""What the demo's console shows while a step runs: one progress line per running stage (step,
loss, tokens/s, ETA, read from the stage's ``metrics.jsonl``), or how long any other step has been
running; the step's log file is named when it starts.

On a terminal the line is rewritten in place; on a pipe or file (a batch job's log) a new line is
printed when the figures change, at most once per :data:`EVERY_S`, so that a 30-minute stage adds a
few dozen lines, not thousands.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional, TextIO

from ..train.progress_line import format_duration, format_si

EVERY_S = 60.0  # at most one printed line per this many seconds when the console is not a terminal
TAIL_BYTES = 1 << 16  # of metrics.jsonl read per update: the last records are all that is shown


class ProgressLine:
    """The console line of the step now running, ``prefix`` + :meth:`show`'s text."""

    def __init__(self, prefix: str, stream: Optional[TextIO] = None,
                 every_s: Optional[float] = None, clock: Callable[[], float] = time.monotonic):
        self.prefix, self.stream = prefix, stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s, self.clock = EVERY_S if every_s is None else every_s, clock
        self.last_text, self.last_time, self.open = "", clock(), False

    def show(self, text: str) -> None:
        if not text or text == self.last_text:
            return
        if self.tty:
            self.stream.write("\r\x1b[K" + self.prefix + text)
            self.open = True
        elif self.clock() - self.last_time >= self.every_s:
            self.stream.write(self.prefix + text + "\n")
        else:
            return
        self.stream.flush()
        self.last_text, self.last_time = text, self.clock()

    def end(self) -> None:
        """Clear an in-place line, so the step's last message starts on a clean line."""
        if self.open:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.open = False


def last_records(path: Path) -> list[dict]:
    """The complete JSON records at the end of ``path`` (empty while it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            start = max(0, f.tell() - TAIL_BYTES)
            f.seek(start)
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    records = []
    for line in lines[1:] if start else lines:  # a seek into the file may cut the first line
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a line still being written
    return records


def stage_status(run_dir: Path, total_steps: int) -> str:
    """``step 7/14 | loss 3.214 | 410 tok/s | ETA 1m40s`` from a stage's latest training record;
    the ETA from the mean step time over the records read (an empty string before the first)."""
    train = [r for r in last_records(Path(run_dir) / "metrics.jsonl") if "train/loss" in r]
    if not train:
        return ""
    last = train[-1]
    step = int(last["step"])
    if len(train) > 1 and step > int(train[0]["step"]):
        per_step = (last["time"] - train[0]["time"]) / (step - int(train[0]["step"]))
    else:
        per_step = last.get("perf/step_time_s")
    eta = None if per_step is None else per_step * max(total_steps - step, 0)
    speed = last.get("perf/tokens_per_s")
    return (f"step {step}/{total_steps} | loss {last['train/loss']:.4g} | "
            f"{'n/a' if speed is None else format_si(speed)} tok/s | ETA {format_duration(eta)}")
