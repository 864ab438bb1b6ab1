"""Learning-rate schedules as pure functions of the optimizer step.

``step`` counts optimizer updates already taken, so ``lr_at(step)`` is the LR of update number
``step`` (0-based) -- exactly what ``LambdaLR`` applies after ``step`` calls to
``scheduler.step()``. Every schedule is linear warm-up (``peak * (step + 1) / warmup``, so the
first update is not wasted at LR 0) followed by:

- ``cosine``:   min + (peak - min) * (1 + cos(pi p)) / 2,  p = (step - W) / (T - W)
- ``linear``:   min + (peak - min) * (1 - p)
- ``constant``: peak
- ``wsd``:      peak until ``decay_start = T - decay_steps``, then min + (peak - min) * f(q),
                q = (step - decay_start) / decay_steps,
                f(q) = 1 - q | (1 + cos(pi q)) / 2 | 1 - sqrt(q)   (decay_shape linear|cosine|sqrt)

p and q are clipped to [0, 1]: past the end the LR stays at min (peak for constant).

WSD is what the on-policy stage extends rung by rung: for every step <= decay_start the
LR does not depend on ``total_steps``, so a run resumed from a pre-decay snapshot with a larger
total retraces the identical LR history. :meth:`LRSchedule.check_resume` enforces that.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from ..errors import IncompatibleInputError

KINDS = ("cosine", "constant", "wsd", "linear")
DECAY_SHAPES = ("linear", "cosine", "sqrt")


@dataclass(frozen=True)
class LRSchedule:
    """Warm-up + decay learning-rate schedule; all fields in optimizer steps and absolute LR."""

    kind: str
    peak_lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int
    decay_steps: Optional[int] = None  # WSD only
    decay_shape: str = "linear"  # WSD only

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"schedule kind must be one of {KINDS}, got {self.kind!r}")
        if not 0 <= self.min_lr <= self.peak_lr or self.peak_lr <= 0:
            raise ValueError(f"need 0 <= min_lr <= peak_lr and peak_lr > 0, "
                             f"got {self.min_lr}, {self.peak_lr}")
        if not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(f"need 0 <= warmup_steps < total_steps, "
                             f"got {self.warmup_steps}, {self.total_steps}")
        if self.kind == "wsd":
            self._validate_wsd()

    def _validate_wsd(self) -> None:
        if self.decay_shape not in DECAY_SHAPES:
            raise ValueError(f"decay_shape must be one of {DECAY_SHAPES}, got {self.decay_shape!r}")
        if self.decay_steps is None or self.decay_steps <= 0:
            raise ValueError(f"wsd needs decay_steps > 0, got {self.decay_steps}")
        if self.warmup_steps + self.decay_steps > self.total_steps:
            raise ValueError(f"warmup {self.warmup_steps} + decay {self.decay_steps} exceeds "
                             f"total_steps {self.total_steps}")

    @classmethod
    def from_config(cls, cfg: Any) -> "LRSchedule":
        """From a :class:`halo_dist.config.RunConfig` (its optim and schedule sections)."""
        sched = cfg.schedule
        return cls(kind=sched.kind, peak_lr=cfg.optim.lr, min_lr=cfg.optim.min_lr,
                   warmup_steps=sched.warmup_steps, total_steps=cfg.total_steps,
                   decay_steps=sched.decay_steps, decay_shape=sched.decay_shape)

    @property
    def decay_start(self) -> int:
        """First step whose successor may have a lower LR; LR at steps <= it ignores total_steps
        for wsd and constant (constant never decays: its decay_start is total_steps)."""
        if self.kind == "wsd":
            return self.total_steps - self.decay_steps
        if self.kind == "constant":
            return self.total_steps
        return self.warmup_steps

    def is_pre_decay(self, step: int) -> bool:
        """True while the LR at ``step`` is still on the warm-up/stable part of the schedule.

        A checkpoint taken after ``step`` updates with ``is_pre_decay(step)`` is a pre-decay
        snapshot: a WSD run may be extended from it with a larger ``total_steps``.
        """
        return step <= self.decay_start

    def lr_at(self, step: int) -> float:
        """Learning rate of update number ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.peak_lr
        if self.kind == "wsd":
            return self._wsd(step)
        progress = _clip01((step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        shape = 1.0 - progress if self.kind == "linear" else _cosine(progress)
        return self.min_lr + (self.peak_lr - self.min_lr) * shape

    def _wsd(self, step: int) -> float:
        if step <= self.decay_start:
            return self.peak_lr
        q = _clip01((step - self.decay_start) / self.decay_steps)
        shape = {"linear": 1.0 - q, "cosine": _cosine(q), "sqrt": 1.0 - math.sqrt(q)}
        return self.min_lr + (self.peak_lr - self.min_lr) * shape[self.decay_shape]

    def multiplier(self, step: int) -> float:
        """``lr_at(step) / peak_lr``: the LambdaLR factor on an optimizer built with lr=peak_lr."""
        return self.lr_at(step) / self.peak_lr

    def state_dict(self) -> dict[str, Any]:
        """Plain-data description, saved with checkpoints for :meth:`check_resume`."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "LRSchedule":
        return cls(**state)

    def check_resume(self, saved: dict[str, Any], step: int) -> None:
        """Refuse to resume at ``step`` if the LR history up to it differs from ``saved``'s.

        Allowed: the same schedule, or a longer WSD (or constant) run resumed from a pre-decay
        snapshot. Refused: anything that would mean the checkpoint was trained with other LRs.
        """
        old = LRSchedule.from_state_dict(saved)
        if old == self:
            return
        for s in range(step + 1):
            if not math.isclose(old.lr_at(s), self.lr_at(s), rel_tol=1e-9, abs_tol=0.0):
                raise IncompatibleInputError(
                    f"cannot resume at step {step}: the new LR schedule differs from the "
                    f"checkpoint's at step {s} ({self.lr_at(s):.3e} vs {old.lr_at(s):.3e}). "
                    f"Only the same schedule, or a longer WSD run resumed from a pre-decay "
                    f"snapshot (step <= {old.decay_start}), may resume. saved={saved}")


def _clip01(x: float) -> float:
    return min(1.0, max(0.0, x))


def _cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def make_lr_scheduler(optimizer: Optimizer, schedule: LRSchedule) -> LambdaLR:
    """A ``LambdaLR`` driving ``optimizer`` (built with ``lr = schedule.peak_lr``) by ``schedule``.

    The factor is a plain closure, which ``LambdaLR.state_dict`` does not save: a resumed run
    uses the schedule rebuilt from its config (needed to extend WSD rungs) while
    ``load_state_dict`` restores the step counter. Save ``schedule.state_dict()`` next to it and
    call :meth:`LRSchedule.check_resume` on resume.
    """
    for group in optimizer.param_groups:
        base = group.get("initial_lr", group["lr"])  # initial_lr: a scheduler already ran
        if not math.isclose(base, schedule.peak_lr, rel_tol=1e-9):
            raise ValueError(f"optimizer lr {base} != schedule peak_lr {schedule.peak_lr}")

    def factor(step: int) -> float:
        return schedule.multiplier(step)

    return LambdaLR(optimizer, factor)
