"""Every place a training run makes the host wait for the GPU, with its Python stack and count per
step.

A host-device synchronisation (``.item()``, ``bool(tensor)``, ``nonzero``, a blocking copy) drains
the GPU's queue: after it, the GPU idles until the host has launched the next kernels. The step
profile (``logging.profile_at_step``) counts the ``cudaStreamSynchronize`` calls and the idle gaps;
this script names the code that makes them. It runs a launcher in this process:

    python bench/find_syncs.py --skip-steps 3 --out bench/results/syncs.json -- \
        launchers/stage2.py --config configs/bench/stage2_2b.yaml schedule.total_steps=5

On CUDA it turns on torch's sync debug mode (every synchronising CUDA call warns) and records the
stack of each warning. On CPU nothing synchronises, so it records the operators that would on a
GPU (``_local_scalar_dense`` behind ``.item()``/``bool()``, ``nonzero``, ``repeat_interleave``
without an output size, ``masked_select``, ``unique``, boolean indexing): the host-side syncs of
our own loop show there too; those inside CUDA-only kernels (fla, flash-attn) only on a GPU.
Steps are counted at the trainer's step boundaries; ``--skip-steps`` leaves out the warm-up, and the
last step is left out too (it also holds the final checkpoint and export), so run two steps more.
"""

from __future__ import annotations

import argparse
import collections
import json
import runpy
import sys
import traceback
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
# operators that read device memory on the host (a stream sync on CUDA)
SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::repeat_interleave",
            "aten::masked_select", "aten::unique", "aten::_unique2", "aten::unique_consecutive",
            "aten::equal"}
SKIP_FRAMES = ("torch/utils/_python_dispatch", "find_syncs.py", "/warnings.py", "torch/_tensor.py",
               "torch/_dynamo/", "torch/_compile.py", "<frozen")
FRAMES = 6


class SyncLog:
    """Counts synchronising calls by (kind, stack); ``step`` is the trainer's step about to run."""

    def __init__(self, skip_steps: int):
        self.skip_steps, self.step, self.first_counted = skip_steps, 0, None
        self.counts: collections.Counter = collections.Counter()

    def before_step(self, step: int) -> None:
        self.step = step
        if step > self.skip_steps and self.first_counted is None:
            self.first_counted = step

    def record(self, kind: str) -> None:
        if self.step <= self.skip_steps:
            return
        frames = [f for f in traceback.extract_stack()
                  if not any(s in f.filename for s in SKIP_FRAMES)]
        site = tuple(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in frames[-FRAMES:])
        self.counts[(self.step, kind, site)] += 1

    def report(self, top: int) -> dict:
        """Per-step counts over the counted steps but the last, which also holds what runs after
        training (the final checkpoint and export); the last one only when it is the only one."""
        last = self.step if self.first_counted is not None and self.step > self.first_counted \
            else None
        steps = 0 if self.first_counted is None else self.step - self.first_counted + (last is None)
        per = max(steps, 1)
        counts: collections.Counter = collections.Counter()
        for (step, kind, site), c in self.counts.items():
            if step != last:
                counts[(kind, site)] += c
        rows = [{"per_step": c / per, "kind": kind, "stack": list(site)}
                for (kind, site), c in counts.most_common(top)]
        return {"steps_counted": steps, "skip_steps": self.skip_steps,
                "syncs_per_step": sum(counts.values()) / per, "sites": rows}


def _short(filename: str) -> str:
    for marker in ("/site-packages/", str(ROOT) + "/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


class _WouldSync(TorchDispatchMode):
    """CPU: record the operators that synchronise on a GPU."""

    def __init__(self, log: SyncLog):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in SYNC_OPS or (name == "aten::index" and _bool_index(args)):
            self.log.record(name)
        return func(*args, **(kwargs or {}))


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else []
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices
               if i is not None)


def _watch_cuda(log: SyncLog):
    """CUDA: torch's sync debug mode warns at every synchronising call; record each warning."""
    torch.cuda.set_sync_debug_mode("warn")
    warnings.filterwarnings("always", message=".*synchronizing CUDA operation.*")
    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" in str(message):
            log.record("cuda sync")
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning


def run(script: str, script_args: list[str], skip_steps: int) -> SyncLog:
    """Run ``script`` as ``__main__`` with ``script_args``, counting syncs after ``skip_steps``."""
    from halo_dist.train.profiling import StepProfiler

    log = SyncLog(skip_steps)
    original = StepProfiler.before_step

    def before_step(self, step: int) -> None:
        log.before_step(step)
        original(self, step)

    StepProfiler.before_step = before_step
    sys.argv = [script, *script_args]
    cuda = torch.cuda.is_available()
    try:
        if cuda:
            _watch_cuda(log)
            _run_main(script)
        else:
            with _WouldSync(log):
                _run_main(script)
    finally:
        StepProfiler.before_step = original
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
    return log


def _run_main(script: str) -> None:
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise


def format_report(r: dict) -> str:
    lines = [f"{r['syncs_per_step']:.1f} synchronising calls per step over {r['steps_counted']} "
             f"steps (after {r['skip_steps']} skipped)"]
    for row in r["sites"]:
        lines.append(f"{row['per_step']:7.1f} per step  {row['kind']}")
        lines += [f"          {frame}" for frame in row["stack"]]
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: find_syncs.py [--skip-steps N] [--top K] [--out JSON] -- "
                         "SCRIPT [ARGS ...]")
    split = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-steps", type=int, default=2, help="warm-up steps not counted")
    p.add_argument("--top", type=int, default=25, help="sites listed")
    p.add_argument("--out", type=Path, default=None, help="write the report as JSON")
    a = p.parse_args(argv[:split])
    script, script_args = argv[split + 1], argv[split + 2:]
    log = run(script, script_args, a.skip_steps)
    report = log.report(a.top)
    report["command"] = [script, *script_args]
    print(format_report(report), flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
