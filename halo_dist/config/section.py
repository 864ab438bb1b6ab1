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
