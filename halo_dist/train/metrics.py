"""One metrics path: accumulate on device, reduce once per interval, rank 0 writes.

The training loop calls :meth:`MetricsLogger.add` every micro-step with device tensors (no host
sync), and :meth:`MetricsLogger.maybe_log` every optimizer step on every rank. Every ``log_every``
steps all accumulated sums go through one ``all_reduce`` and one ``.tolist()``; rank 0 then writes
TensorBoard scalars, a JSONL mirror (``<run_dir>/metrics.jsonl``, for tests and plots), the same
scalars to W&B when ``logging.wandb`` names a project, and one human progress line::

    step 120/20000 (0.6%) | loss 2.3141 | lr 9.8e-05 | 16.2K tok/s | MFU 31.4% \
        | mem 41.2/80.0 GiB | ETA 5h12m        (one line)

Tags live in fixed namespaces (:data:`NAMESPACES`); any other tag is a bug and raises.

A failed write (a full disk, no inodes, a quota, a folder gone read-only) does not raise here:
rank 0 alone writes, and a rank raising alone would leave the others in the next collective. The
first is kept in :attr:`MetricsLogger.write_error`, the writer closed, and the trainer stops at the
end of the step with a checkpoint (``stopping.StopControl``), as on a stop signal. Stopping, not
going on with a warning: such a failure nearly always means the run folder's disk is full or
read-only, so the next checkpoint would fail too and the steps since the last one be lost; saving
now keeps them, and the metrics lose only the records that failed (a resumed run logs on from its
checkpoint).
At start-up :meth:`MetricsLogger.log_config` records the resolved config (TB text
``config/resolved``) and the flattened hyperparameters (TB's hparams table, W&B's run config).
"""
from __future__ import annotations

import json
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from ..config.coerce import fail
from .disk import cause, quiet_tensorboard_thread_errors
from .progress_line import format_progress

NAMESPACES = ("train", "optim", "perf", "mem", "progress", "eval")
ATTENDED = "perf/attended_keys"  # keys per token under the document mask (token-weighted), for MFU
GIB = 1024**3
# Dense bf16 FLOP/s per device for MFU. H200: the bf16 matmul ceiling measured on the lent H200
# (BENCHMARKS.md); others: datasheet dense peaks (SXM parts). Matched by substring, in order (GH200
# before H200).
PEAK_FLOPS = (
    ("GH200", 989e12), ("H200", 779e12), ("H100", 989e12), ("H800", 989e12), ("B200", 2250e12),
    ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12),
)
Number = Union[float, int, torch.Tensor]
HParam = Union[float, int, str, bool]
# TB text tag of the resolved config (outside NAMESPACES: not a scalar; add_text stores it as
# <tag>/text_summary)
CONFIG_TAG = "config/resolved"
# <run_dir>/wandb_id: the W&B run id, so a resumed run continues the same W&B run
WANDB_ID = "wandb_id"


def check_wandb(project: Optional[str]) -> None:
    """``logging.wandb`` set but wandb not importable: a ConfigError before anything is built (not
    at step 1)."""
    if project is None:
        return
    try:
        import wandb  # noqa: F401
    except ImportError as err:
        fail("logging.wandb", f"W&B project {project!r} is set but wandb does not import ({err}): "
             "pip install wandb, or set logging.wandb null")


def flatten_hparams(tree: dict, prefix: str = "") -> dict[str, HParam]:
    """A nested config dict as ``{"optim.lr": 3e-4, ...}`` of TB-hparams-safe values (numbers,
    strings, bools): null becomes "null", a list its comma-joined items."""
    flat: dict[str, HParam] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_hparams(value, name + "."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        elif isinstance(value, (list, tuple)):
            flat[name] = ",".join(map(str, value))
        else:
            flat[name] = "null" if value is None else str(value)
    return flat


def run_hparams(cfg: Any, layout: Any) -> dict[str, HParam]:
    """Every config field plus the batch layout derived for this world size (``layout.dp`` ...)."""
    from ..config import to_dict

    derived = {"world": layout.world_size, "dp": layout.dp_size, "sp": layout.sp_size,
               "micro_batch": layout.micro_batch_size, "grad_accum": layout.grad_accum_steps,
               "global_batch": layout.global_batch_size, "total_steps": cfg.total_steps}
    return {**flatten_hparams(to_dict(cfg)), **flatten_hparams(derived, "layout.")}


def check_tag(tag: str) -> str:
    """Return ``tag`` if it is ``<namespace>/<name>`` with a known namespace, else raise."""
    namespace, sep, name = tag.partition("/")
    if not sep or not name or namespace not in NAMESPACES:
        raise ValueError(f"metric tag {tag!r} is outside the namespaces "
                         f"{', '.join(n + '/' for n in NAMESPACES)}")
    return tag


def attended_context(cu_seqlens: torch.Tensor) -> float:
    """Keys per token under document masking, PaLM-style (each token of a document of n tokens
    counts n): sum(n_i^2) / sum(n_i) over the packed batch's documents. A 512K row of 17K-token
    documents attends ~17K keys per token, not 512K: counting the row length would overstate
    long-context MFU ~30x."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.float64)
    total = float(lengths.sum())
    return float((lengths * lengths).sum()) / total if total else 0.0


def peak_flops_for(device_name: Optional[str]) -> Optional[float]:
    """Per-device dense bf16 FLOP/s for a CUDA device name; None when unknown (MFU is n/a)."""
    if not device_name:
        return None
    upper = device_name.upper()
    return next((flops for key, flops in PEAK_FLOPS if key in upper), None)


def device_peak_flops(device: Optional[torch.device] = None,
                      override: Optional[float] = None) -> Optional[float]:
    """``override`` (config ``logging.peak_flops``) if set, else by device name; None on CPU."""
    if override is not None:
        return override
    device = torch.device(device) if device is not None else _default_device()
    if device.type != "cuda":
        return None
    return peak_flops_for(torch.cuda.get_device_name(device))


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def memory_stats(device: torch.device) -> dict[str, float]:
    """``mem/*`` scalars in GiB for a CUDA device (host-side counters, no sync); {} on CPU."""
    if device.type != "cuda":
        return {}
    total = torch.cuda.get_device_properties(device).total_memory
    return {"mem/allocated_gib": torch.cuda.memory_allocated(device) / GIB,
            "mem/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "mem/reserved_gib": torch.cuda.memory_reserved(device) / GIB,
            "mem/total_gib": total / GIB}


class MetricsLogger:
    """Interval metrics for a training run; every rank calls ``add`` and ``maybe_log`` alike.

    All ranks must ``add`` the same tags (the reduction stacks them in sorted-tag order).
    ``tokens_seen`` passed to ``log`` is the global count (all data-parallel ranks).
    """

    def __init__(self, run_dir: Union[str, Path], *, total_steps: int, log_every: int = 10,
                 rank: int = 0, world_size: int = 1, tensorboard: bool = True, jsonl: bool = True,
                 flops_per_token: Optional[float] = None, peak_flops: Optional[float] = None,
                 attn_flops_per_key: float = 0.0,
                 device: Optional[torch.device] = None, group: Any = None, start_step: int = 0,
                 start_tokens: int = 0, clock: Callable[[], float] = time.perf_counter,
                 emit: Callable[[str], None] = print, wandb: Optional[str] = None):
        self.run_dir, self.total_steps, self.log_every = Path(run_dir), total_steps, log_every
        self.rank, self.world_size, self.group = rank, world_size, group
        self.device = torch.device(device) if device is not None else _default_device()
        self.flops_per_token, self.clock, self.emit = flops_per_token, clock, emit
        # attention FLOPs per token per attended key; the attended keys come from add(ATTENDED, ...)
        # per batch
        self.attn_flops_per_key = attn_flops_per_key
        self.peak_flops = device_peak_flops(self.device, peak_flops)
        self._sums: dict[str, torch.Tensor] = {}
        self._weights: dict[str, torch.Tensor] = {}
        self._last = (clock(), start_step, start_tokens)
        self._timed = (0.0, 0)  # seconds and steps measured after the first (warm-up) interval
        self._intervals = 0
        self._tb = self._jsonl = self._wandb = None
        self._start_step = start_step
        self.last_eval: dict[str, float] = {}  # the latest log_eval scalars (rank 0)
        self.write_error: Optional[str] = None  # the first failed write (rank 0; module doc)
        if rank == 0:
            self._open_writers(tensorboard, jsonl, start_step)
            if wandb is not None:
                self._wandb = open_wandb(wandb, self.run_dir, resumed=start_step > 0)

    @classmethod
    def from_config(cls, cfg: Any, **kwargs: Any) -> "MetricsLogger":
        """From a RunConfig's logging section; ``kwargs``: rank, world_size, flops_per_token..."""
        log = cfg.logging
        return cls(log.run_dir, total_steps=cfg.total_steps, log_every=log.log_every,
                   tensorboard=log.tensorboard, peak_flops=log.peak_flops, wandb=log.wandb,
                   **kwargs)

    def _open_writers(self, tensorboard: bool, jsonl: bool, start_step: int) -> None:
        """A run resumed at ``start_step`` continues one history: steps it will redo (logged after
        its checkpoint by the run that stopped) are dropped from metrics.jsonl and purged from
        TensorBoard. A fresh run (``start_step`` 0) starts both afresh."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # slow import: rank 0 only

            quiet_tensorboard_thread_errors()
            # events at steps >= purge_step from earlier writers of this folder are hidden
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"),
                                     purge_step=start_step + 1 if start_step else 0)
        if jsonl:
            path = self.run_dir / "metrics.jsonl"
            if path.exists():
                truncate_metrics(path, start_step)
            self._jsonl = open(path, "a", encoding="utf-8")

    def log_config(self, config_text: str, hparams: dict[str, HParam]) -> None:
        """Rank 0: the resolved config as TB text and ``hparams`` (:func:`run_hparams`) in TB's
        hparams table and W&B's run config. TB gets them once, from the run that starts at step 0: a
        resumed run's writer purges only steps after its checkpoint, so the first copy stays and no
        second one is added."""
        if self._wandb is not None:
            self._wandb.config.update(hparams, allow_val_change=True)
        if self._tb is None or self._start_step:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        def write() -> None:
            # 4-space indent: a markdown code block, so the YAML keeps its layout in the text plugin
            self._tb.add_text(CONFIG_TAG,
                              "".join(f"    {line}\n" for line in config_text.splitlines()), 0)
            # the summaries add_hparams writes, but into this run's folder (add_hparams makes a new
            # sub-run); the metric column shows this run's train/loss scalars
            for summary in hparams_summary(hparams, {"train/loss": math.nan}):
                self._tb.file_writer.add_summary(summary, 0)
            self._tb.flush()

        self._guard("tb", write)

    def add(self, tag: str, value: Number, weight: Number = 1.0) -> None:
        """Accumulate ``value`` (weighted mean over the interval; e.g. weight = token count).

        Tensors stay on their device: ``+=`` enqueues a kernel and never waits for the GPU.
        """
        if tag not in self._sums:
            check_tag(tag)
            dev = value.device if isinstance(value, torch.Tensor) else self.device
            self._sums[tag] = torch.zeros((), dtype=torch.float64, device=dev)
            self._weights[tag] = torch.zeros((), dtype=torch.float64, device=dev)
        if isinstance(value, torch.Tensor):
            value = value.detach().reshape(()).to(torch.float64)
        if isinstance(weight, torch.Tensor):
            weight = weight.detach().reshape(()).to(torch.float64)
        self._sums[tag] += value * weight
        self._weights[tag] += weight

    def should_log(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.total_steps

    def maybe_log(self, step: int, tokens_seen: int, lr: Optional[float] = None,
                  ) -> Optional[dict[str, float]]:
        """:meth:`log` on interval boundaries (collective: call on every rank every step)."""
        return self.log(step, tokens_seen, lr) if self.should_log(step) else None

    def log(self, step: int, tokens_seen: int, lr: Optional[float] = None) -> dict[str, float]:
        """Reduce the interval (one collective, one host sync) and, on rank 0, write it.

        ``step``: optimizer steps completed; ``lr``: the LR of the last update. Returns the
        scalars (on every rank) so callers can act on e.g. a non-finite loss consistently.
        """
        scalars = self._reduce()
        scalars.update(self._rates(step, tokens_seen, scalars.get(ATTENDED)))
        scalars.update(memory_stats(self.device))
        if lr is not None:
            scalars["optim/lr"] = float(lr)
        if self.rank == 0:
            self._write(step, scalars)
        return scalars

    def _reduce(self) -> dict[str, float]:
        tags = sorted(self._sums)
        if not tags:
            return {}
        stacked = torch.stack([self._sums[t] for t in tags] + [self._weights[t] for t in tags])
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(stacked, group=self.group)
        values = stacked.tolist()  # the interval's single host sync
        self._sums.clear()
        self._weights.clear()
        n = len(tags)
        return {t: values[i] / values[n + i] if values[n + i] else math.nan
                for i, t in enumerate(tags)}

    def _rates(self, step: int, tokens_seen: int,
               attended: Optional[float] = None) -> dict[str, float]:
        now = self.clock()
        last_time, last_step, last_tokens = self._last
        self._last = (now, step, tokens_seen)
        elapsed, steps = now - last_time, step - last_step
        self._intervals += 1
        if self._intervals > 1:  # the first interval includes compilation and warm-up
            self._timed = (self._timed[0] + elapsed, self._timed[1] + steps)
        out = {"progress/tokens": float(tokens_seen), "progress/step": float(step)}
        if elapsed <= 0 or steps <= 0:
            return out
        tok_s = (tokens_seen - last_tokens) / elapsed
        out.update({"perf/tokens_per_s": tok_s,
                    "perf/tokens_per_s_per_gpu": tok_s / self.world_size,
                    "perf/step_time_s": elapsed / steps})
        if self.flops_per_token and self.peak_flops:
            fpt = self.flops_per_token + self.attn_flops_per_key * (attended or 0.0)
            out["perf/mfu"] = tok_s / self.world_size * fpt / self.peak_flops
        return out

    def eta_seconds(self, step: int, step_time: Optional[float]) -> Optional[float]:
        """Remaining time from the mean step time after the first interval (else the last one)."""
        seconds, steps = self._timed
        per_step = seconds / steps if steps > 0 else step_time
        return None if per_step is None else per_step * max(self.total_steps - step, 0)

    def _write(self, step: int, scalars: dict[str, float]) -> None:
        self._record(step, scalars)
        self.emit(self.progress_line(step, scalars))

    def _record(self, step: int, scalars: dict[str, float]) -> None:
        """TensorBoard scalars and the same values as one JSONL line (rank 0)."""
        if self._tb is not None:
            def tensorboard() -> None:
                for tag, value in scalars.items():
                    self._tb.add_scalar(tag, value, step)
                self._tb.flush()

            self._guard("tb", tensorboard)
        if self._jsonl is not None:
            def jsonl() -> None:
                self._jsonl.write(json.dumps({"step": step, "time": time.time(), **scalars})
                                  + "\n")
                self._jsonl.flush()

            self._guard("metrics.jsonl", jsonl)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def progress_line(self, step: int, scalars: dict[str, float]) -> str:
        mem = None
        if "mem/peak_allocated_gib" in scalars:
            mem = (scalars["mem/peak_allocated_gib"], scalars["mem/total_gib"])
        return format_progress(
            step, self.total_steps, loss=scalars.get("train/loss"), lr=scalars.get("optim/lr"),
            tokens_per_s=scalars.get("perf/tokens_per_s"), mfu=scalars.get("perf/mfu"),
            mem_gib=mem, eta_s=self.eta_seconds(step, scalars.get("perf/step_time_s")))

    def log_eval(self, step: int, scalars: dict[str, float],
                 seconds: Optional[float] = None) -> None:
        """Write already-reduced evaluation scalars (tags ``eval/...``) on rank 0.

        ``seconds`` (the evaluation's wall time, on every rank) is left out of the current
        interval's training throughput and logged as ``perf/eval_seconds``."""
        for tag in scalars:
            if not tag.startswith("eval/"):
                raise ValueError(f"log_eval takes eval/ tags, got {tag!r}")
        if seconds is not None:
            last_time, last_step, last_tokens = self._last
            self._last = (last_time + seconds, last_step, last_tokens)
        if self.rank != 0:
            return
        scalars = {tag: float(value) for tag, value in scalars.items()}
        self.last_eval = scalars
        timing = {} if seconds is None else {"perf/eval_seconds": float(seconds)}
        self._record(step, {**scalars, **timing})
        shown = " | ".join(f"{tag[len('eval/'):]} {value:.4f}" for tag, value in scalars.items())
        self.emit(f"eval @ step {step} | {shown}"
                  + ("" if seconds is None else f" | {seconds:.1f}s"))

    def _guard(self, name: str, write: Callable[[], None]) -> None:
        """Run one writer's ``write``; a failed write is kept in :attr:`write_error` and closes
        that writer (module doc)."""
        try:
            write()
        except OSError as e:
            path = self.run_dir / name
            self.write_error = self.write_error or f"writing {path} failed: {cause(e, path)}"
            self._drop(name)

    def _drop(self, name: str) -> None:
        """Close writer ``name`` (``tb`` or ``metrics.jsonl``) whose file cannot be written: what
        it still buffers is lost."""
        writer = self._tb if name == "tb" else self._jsonl
        setattr(self, "_tb" if name == "tb" else "_jsonl", None)
        try:
            writer.close()
        except OSError:
            pass

    def close(self) -> None:
        """Close the writers; a failed final write is kept in :attr:`write_error` and printed (the
        run's checkpoint and output are written by then)."""
        for name, writer in (("tb", self._tb), ("metrics.jsonl", self._jsonl)):
            if writer is not None:
                self._guard(name, writer.close)
        if self.write_error is not None:
            self.emit(f"warning: {self.write_error}")
        if self._wandb is not None:
            self._wandb.finish()
        self._tb = self._jsonl = self._wandb = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_wandb(project: str, run_dir: Path, resumed: bool) -> Any:
    """The W&B run of ``run_dir``: a new one for a run starting at step 0 (like TB, which then
    purges the folder's old events), the same id again for a resumed run.

    W&B cannot purge: the steps a resumed run redoes (logged after its checkpoint before the stop)
    arrive again with a step below the run's last one, which W&B drops with a warning; later steps
    log normally."""
    import wandb

    id_file = run_dir / WANDB_ID
    run_id = id_file.read_text().strip() if resumed and id_file.exists() else uuid.uuid4().hex[:16]
    id_file.write_text(run_id + "\n")
    return wandb.init(project=project, id=run_id, resume="allow", name=run_dir.name,
                      dir=str(run_dir))


def truncate_metrics(path: Path, last_step: int) -> int:
    """Keep the records of steps ``<= last_step`` (none when it is 0; a torn line never); returns
    how many were dropped.

    Rewritten atomically: a crash here leaves the old file or the new one, never a torn one."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    steps = [_record_step(line) for line in lines]
    kept = [line for line, step in zip(lines, steps)
            if last_step and step is not None and step <= last_step]
    if len(kept) == len(lines):
        return 0
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)
    return len(lines) - len(kept)


def _record_step(line: str) -> Optional[int]:
    """The step of one JSONL record; None for a line torn by a hard kill mid-write."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def read_metrics(path: Union[str, Path]) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` from a metrics.jsonl (a run folder or the file itself).

    A resumed run re-logs steps after its checkpoint; the later record of a step wins.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    series: dict[str, dict[int, float]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        step = int(record.pop("step"))
        record.pop("time", None)
        for tag, value in record.items():
            series.setdefault(tag, {})[step] = float(value)
    return {tag: sorted(points.items()) for tag, points in series.items()}
