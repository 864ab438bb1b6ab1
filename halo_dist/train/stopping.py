"""Stopping a run at a step boundary, shared by every trainer (``trainer.Trainer``,
``halo_dist.opd.trainer.OPDTrainer``).

Two causes, both agreed by all ranks with one all-reduce so every rank takes the same branch:

- a signal (SIGTERM: Slurm preemption or ``scancel``; SIGUSR1: Slurm's ``--signal`` warning). The
  handler only records it; at the end of the step the ranks agree, the trainer checkpoints and
  :class:`StopRequested` is raised (the launchers exit 0; a restarted job resumes from that
  checkpoint).
- a non-finite loss (``optim.nonfinite``, :class:`NonFinitePolicy`): skip the step, or let the
  trainer checkpoint its last good state and raise :class:`NonFiniteLossError`.
- rank 0 could not write the run's metrics (``metrics.MetricsLogger.write_error``: a full disk, a
  folder gone read-only): agreed at the end of the step like a signal; the trainer checkpoints and
  :class:`~.disk.WriteError` names the file and the cause (the metrics module doc says why the run
  stops rather than going on).

Non-finite losses (``optim.nonfinite``, :class:`NonFinitePolicy`): every micro-batch's loss is
checked before its backward and the ranks agree (one all-reduce of a flag), so every rank takes the
same branch. ``stop`` checkpoints the last good state and raises :class:`NonFiniteLossError`.
``skip`` drops the whole optimizer step: the flagged micro-batch (and the rest of the step) is
back-propagated with a NaN-poisoned loss, so DeepSpeed's own overflow path (the fp16 loss-scaler
machinery; in 0.19.8 ZeRO-1/2/3 and the bf16 optimizer treat a non-finite global gradient norm as an
overflow) clears every gradient buffer and applies no update; the plain torch optimizer that ZeRO
stage 0 in fp32 uses has no such path, so its ``step`` is a no-op during that boundary
``engine.step()`` (DeepSpeed's own clipping, gradient reset and bookkeeping still run). A skipped
step still counts as a step: the batch is consumed, ``step`` and the LR schedule advance (the LR
stays a function of the step, so WSD snapshots, rungs and resume checks keep their meaning), Adam's
moments and step count do not.
More than ``optim.max_skipped_steps`` consecutive skips stop the run like ``stop``.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import HaloUserError
from .disk import WriteError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequested(Exception):
    """A signal asked the run to stop; raised after the checkpoint was written."""


class NonFiniteLossError(HaloUserError, RuntimeError):
    """The loss became NaN/inf; the last good state was checkpointed before raising. A user-facing
    stop (the message says what to change before resuming), not a bug."""


class NonFinitePolicy:
    """``optim.nonfinite``: stop at a non-finite loss, or skip up to ``max_skipped`` consecutive
    steps."""

    def __init__(self, mode: str = "stop", max_skipped: int = 0):
        self.mode, self.max_skipped = mode, max_skipped
        self.consecutive = 0  # skipped steps in a row, up to the current one
        self.total = 0  # skipped steps of the whole run (resumed runs continue the count)

    @classmethod
    def from_config(cls, optim) -> "NonFinitePolicy":
        return cls(optim.nonfinite, optim.max_skipped_steps)

    def should_skip(self) -> bool:
        """A step had a non-finite loss: True = skip it (counted), False = stop the run."""
        if self.mode != "skip" or self.consecutive >= self.max_skipped:
            return False
        self.consecutive += 1
        self.total += 1
        return True

    def step_ok(self) -> None:
        self.consecutive = 0

    def stop_reason(self) -> str:
        if self.mode == "skip":
            return (f"{self.consecutive + 1} non-finite steps in a "
                    "row exceed optim.max_skipped_steps="
                    f"{self.max_skipped} ({self.total} skipped in this run)")
        return "optim.nonfinite=stop"

    def skip_message(self, step: int, what: str = "loss") -> str:
        return (f"step {step}: non-finite {what}, step skipped (no update; {self.consecutive} in a "
                f"row, {self.total} in this run, at most {self.max_skipped} in a row)")

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "total": self.total}

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        self.consecutive, self.total = int(state.get("consecutive", 0)), int(state.get("total", 0))


def any_rank(flag: bool | torch.Tensor, device: torch.device) -> bool:
    """True on every rank when ``flag`` is True on any rank: one all-reduce and one host read.
    ``flag`` may be a 0-dim tensor already on ``device`` (filled without a host-to-device copy,
    which would be a second synchronisation)."""
    t = (flag.reshape(1).float() if torch.is_tensor(flag)
         else torch.full((1,), 1.0 if flag else 0.0, device=device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def is_nonfinite(loss: torch.Tensor) -> torch.Tensor:
    """0-dim bool on the loss's device, True when any element is NaN/inf. No host sync: a step
    ORs it over its micro-batches and reads it once (:meth:`StopControl._nonfinite`)."""
    return ~torch.isfinite(loss.detach()).all()


class StopControl:
    """The trainers' stop handling. The trainer provides ``rank``, ``device``, ``step``,
    ``nonfinite`` (a :class:`NonFinitePolicy`), ``save()`` (a collective checkpoint of the state
    after ``step`` steps) and ``_nonfinite_stop()`` (checkpoint the last good state, return the
    :class:`NonFiniteLossError` to raise)."""

    stop_signal: int | None = None
    nonfinite_what = "loss"  # names the loss in the skip message

    def _install_signal_handlers(self) -> None:
        """The handler only records the signal; ranks agree at the next step boundary."""

        def handler(signum, frame):
            self.stop_signal = signum

        for sig in STOP_SIGNALS:
            signal.signal(sig, handler)

    def _stop_if_signalled(self) -> None:
        """At a step boundary: if any rank got a stop signal, or rank 0 could not write the metrics,
        checkpoint and raise :class:`StopRequested` (or the metrics' :class:`~.disk.WriteError`).
        One all-reduce of both flags and one host read."""
        failed = getattr(getattr(self, "metrics", None), "write_error", None)
        flags = torch.zeros(2, device=self.device)
        if self.stop_signal is not None:
            flags[0] = 1.0
        if failed is not None:
            flags[1] = 1.0
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signalled, metrics_failed = (flags > 0).tolist()
        if not (signalled or metrics_failed):
            return
        path: Path = self.save()
        if metrics_failed:
            box = [failed]
            dist.broadcast_object_list(box, src=0)  # only rank 0 writes metrics
            raise WriteError(f"{box[0]}; the run stopped at step {self.step} with its checkpoint "
                             f"in {path}: free space (or make the folder writable) and start it "
                             "again to resume")
        raise StopRequested(f"stopped by signal {self.stop_signal} at step {self.step}; "
                            f"checkpoint saved in {path}")

    def _nonfinite(self, bad: torch.Tensor) -> bool:
        """Agree across ranks on a non-finite loss (``bad``: :func:`is_nonfinite`, or several
        OR-ed): False (finite), True (skip this step, ``optim.nonfinite=skip``), or checkpoint the
        last good state and raise :class:`NonFiniteLossError`."""
        if not any_rank(bad, self.device):
            return False
        if self.nonfinite.should_skip():
            if self.rank == 0:
                print(self.nonfinite.skip_message(self.step + 1, self.nonfinite_what), flush=True)
            return True
        raise self._nonfinite_stop()

    def _nonfinite_stop(self) -> NonFiniteLossError:
        """Each trainer (Trainer, OPDTrainer) checkpoints its own last good state and returns the
        error."""
        raise NotImplementedError(f"{type(self).__name__} does not say how it stops on a "
                                  "non-finite loss")


def backward_and_step(engine, loss: torch.Tensor, drop: bool = False) -> None:
    """``engine.backward(loss); engine.step()``; ``drop``: the micro-batch belongs to a skipped
    step.

    Where DeepSpeed's optimizer has an overflow path the loss is poisoned with NaN (the boundary
    step then drops every gradient buffer and applies nothing); a plain torch optimizer (ZeRO 0,
    fp32) has its ``step`` replaced by a no-op for the boundary ``engine.step()`` instead, which
    DeepSpeed then follows with its usual gradient reset and scheduler step (module doc). Every rank
    must pass the same ``drop``: the backward is collective under ZeRO.
    """
    overflow_path = hasattr(engine.optimizer, "overflow")
    if drop and overflow_path:
        loss = loss * float("nan")
    engine.backward(loss)
    if drop and not overflow_path and engine.is_gradient_accumulation_boundary():
        with _no_update(engine.optimizer):
            engine.step()
    else:
        engine.step()


@contextmanager
def _no_update(optimizer):
    """``optimizer.step()`` does nothing inside (parameters, moments and step counts untouched)."""
    saved = optimizer.__dict__.get("step")
    optimizer.step = lambda *args, **kwargs: None
    try:
        yield
    finally:
        if saved is None:
            del optimizer.step
        else:
            optimizer.step = saved


def finish_skipped_step(engine, scheduler) -> None:
    """After the boundary ``engine.step()`` of a skipped step: check no update was applied and keep
    the LR schedule a function of the step (DeepSpeed's overflow path does not step the scheduler;
    the plain-optimizer path of :func:`backward_and_step` went through DeepSpeed's, which does)."""
    if hasattr(engine.optimizer, "overflow"):
        if engine.was_step_applied():
            raise RuntimeError("DeepSpeed applied an update with non-finite gradients; refusing to "
                               "continue")
        if scheduler is not None:
            scheduler.step()
