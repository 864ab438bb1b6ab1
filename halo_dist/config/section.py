"""The base of every config section: typed fields coerced on construction, then validated."""

from __future__ import annotations

from dataclasses import dataclass

from .coerce import coerce_fields, fail


@dataclass(kw_only=True, frozen=True)
class Section:
    """Base of every config section: coerce field types, then run ``validate``."""

    def __post_init__(self) -> None:
        coerce_fields(self)
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` (via ``fail``) on an impossible value; keys are relative."""


def _positive(key: str, value: float | int) -> None:
    if value <= 0:
        fail(key, f"must be > 0, got {value}")


def _non_negative(key: str, value: float | int) -> None:
    if value < 0:
        fail(key, f"must be >= 0, got {value}")


# Bounds on what a run can mean, to catch a slipped exponent before a job queues. AdamW moves each
# weight by about lr per step, so a peak above 1 overwrites the weights in one step (typical peaks
# are 1e-5..1e-3). A billion optimizer steps is decades of compute, a quadrillion tokens ~70x the
# largest published pretraining runs.
MAX_LR = 1.0
MAX_STEPS = 10**9
MAX_TOKENS = 10**15


def _learning_rate(key: str, value: float) -> None:
    """A peak or floor learning rate: >= 0 and at most :data:`MAX_LR`."""
    _non_negative(key, value)
    if value > MAX_LR:
        fail(key, f"must be <= {MAX_LR:g} (AdamW moves each weight by about lr per step; typical "
                  f"peaks are 1e-5..1e-3), got {value:g}")


def _at_most(key: str, value: int, limit: int, what: str) -> None:
    if value > limit:
        fail(key, f"{value:,} is more than any run needs: at most {limit:,} {what}")
