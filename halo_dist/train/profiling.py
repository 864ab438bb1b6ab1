"""A torch.profiler window over a few optimizer steps
(``logging.profile_at_step``/``profile_steps``).

It answers the first question about a slow run: is the GPU busy, or waiting for the host to launch
kernels? Rank 0 profiles steps ``[at, at + steps)`` (1-based, as in the progress line) and writes to
``<run_dir>/profile/``:

  summary.json  wall and device-busy milliseconds per step, their ratio, kernels per step, and the
                operators that take the most device time and the most host time
  summary.txt   the same as tables (also printed)
  trace.json    a Chrome trace (chrome://tracing or https://ui.perfetto.dev)

On a GPU the summary also lists the device's idle gaps, each named by the host operator whose
launch ended it and by the synchronisation that preceded it (``profile_gaps.py``).

Device-busy time is the sum of the kernels' durations, so overlapping streams count twice; on one
stream ``busy / wall`` well below 1 means the host, not the GPU, sets the pace.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import torch

from halo_dist.train.profile_gaps import format_gaps, idle_gaps

TOP = 15
# Kernel groups of a training step, by kernel name (the first match wins): where a step's device
# time goes at a glance. "fused (inductor)" is torch.compile's Triton code (norms, RoPE, gates, the
# compiled loss); "eager elementwise" is what no compiler fused.
KERNEL_GROUPS = [
    ("attention", r"flash|fmha|attention|flex|sdpa|_attn"),
    ("fla rnn", r"chunk_|fused_recurrent|recurrent|gla|lightning|delta"),
    ("gemm", r"gemm|gemv|cutlass|nvjet|xmma|cublas|sm90_|splitK|dot_kernel"),
    ("nccl", r"nccl"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("fused (inductor)", r"^triton_"),
    ("copy/cast", r"copy|Memcpy|memcpy|Memset|memset|cast|index|scatter|gather|cat_|fill"),
    ("reduce", r"reduce|softmax|logsumexp|max_kernel|sum_kernel|norm"),
    ("eager elementwise", r"elementwise|vectorized|unrolled"),
]


def process_age_s() -> float | None:
    """Seconds since this process started (Linux ``/proc``; None elsewhere). Printed at a stage's
    setup and end, it splits a short job's wall time into interpreter start and imports, the stage
    itself, and exit."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(after_name[19])  # field 22 of proc(5), counted after the "(comm)" field
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class StepProfiler:
    def __init__(self, at_step: int, steps: int, run_dir: str | Path, rank: int,
                 device: torch.device):
        self.first, self.last = at_step, at_step + steps - 1
        self.enabled = at_step > 0 and rank == 0
        self.folder = Path(run_dir) / "profile"
        self.cuda = device.type == "cuda"
        self._prof = None
        self._t0 = 0.0

    def before_step(self, step: int) -> None:
        """``step``: the 1-based optimizer step about to run."""
        if not self.enabled or step != self.first:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._sync()
        self._prof = profile(activities=activities)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def after_step(self, step: int) -> None:
        """``step``: the 1-based optimizer step that just ran (also call it when the run stops
        early)."""
        if self._prof is None or step < self.last:
            return
        self._sync()
        wall = time.perf_counter() - self._t0
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        steps = step - self.first + 1
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / "trace.json"
        prof.export_chrome_trace(str(trace))
        summary = summarize(prof, wall, steps, self.first)
        if self.cuda:
            summary["idle_gaps"] = idle_gaps(json.loads(trace.read_text()), steps)
        (self.folder / "summary.json").write_text(json.dumps(summary, indent=2))
        text = format_summary(summary)
        (self.folder / "summary.txt").write_text(text)
        print(text, flush=True)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _device_us(event) -> float:
    return float(getattr(event, "self_device_time_total", 0.0) or 0.0)


def kernel_group(name: str) -> str:
    """The ``KERNEL_GROUPS`` entry of a kernel name, else "other"."""
    return next((group for group, pattern in KERNEL_GROUPS
                 if re.search(pattern, name, re.IGNORECASE)), "other")


def summarize(prof, wall_s: float, steps: int, first: int) -> dict:
    events = prof.key_averages()
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) is not None
               and e.device_type.name in ("CUDA", "PRIVATEUSE1") and _device_us(e) > 0]
    # the kernels themselves: an operator's row (aten::mm) carries its kernels' time too, so summing
    # the averaged rows would count every GEMM twice
    busy_us = sum(_device_us(e) for e in kernels)
    groups: dict[str, float] = {}
    for e in kernels:
        group = kernel_group(e.name)
        groups[group] = groups.get(group, 0.0) + _device_us(e) / 1e3 / steps

    def top(key) -> list[dict]:
        rows = sorted(events, key=key, reverse=True)[:TOP]
        return [{"name": e.key[:90], "calls_per_step": e.count / steps,
                 "device_ms_per_step": _device_us(e) / 1e3 / steps,
                 "host_ms_per_step": e.self_cpu_time_total / 1e3 / steps} for e in rows]

    wall_ms = wall_s * 1e3 / steps
    return {"steps": [first, first + steps - 1], "wall_ms_per_step": wall_ms,
            "device_busy_ms_per_step": busy_us / 1e3 / steps,
            "device_busy_fraction": busy_us / 1e3 / steps / wall_ms if wall_ms > 0 else None,
            "kernels_per_step": len(kernels) / steps,
            "kernel_groups_ms_per_step": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
            "top_device": top(_device_us) if busy_us > 0 else [],
            "top_host": top(lambda e: e.self_cpu_time_total)}


def format_summary(s: dict) -> str:
    busy = s["device_busy_fraction"]
    lines = [f"profile of steps {s['steps'][0]}-{s['steps'][1]}: {s['wall_ms_per_step']:.1f} "
             f"ms per step, device busy {s['device_busy_ms_per_step']:.1f} ms"
             + (f" ({busy:.0%})" if busy is not None else "")
             + f", {s['kernels_per_step']:.0f} kernels per step"]
    groups = s.get("kernel_groups_ms_per_step") or {}
    if groups:
        lines.append("  kernel groups (device ms per step): "
                     + ", ".join(f"{g} {ms:.1f}" for g, ms in groups.items()))
    for title, rows in (("most device time", s["top_device"]), ("most host time", s["top_host"])):
        if not rows:
            continue
        lines += [f"  {title} (per step):  device ms | host ms | calls | operator"]
        lines += [f"    {r['device_ms_per_step']:9.2f} | {r['host_ms_per_step']:7.2f} | "
                  f"{r['calls_per_step']:5.0f} | {r['name']}" for r in rows]
    if s.get("idle_gaps"):
        lines += format_gaps(s["idle_gaps"])
    return "\n".join(lines)
