"""Typed construction of config dataclasses from plain dicts.

Everything that turns YAML values and ``key=value`` strings into typed fields lives here:
coercion by the declared field type, unknown-key detection with "did you mean" suggestions,
and :class:`ConfigError`, which carries every problem found (one line per dotted key) so a user
fixes a config in one round instead of one error at a time.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

import yaml

from ..errors import HaloUserError

UNKNOWN_KEY = "unknown key"
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NONE = {"none", "null", "~"}
# Decimal suffixes accepted for integer fields ("320M" tokens, "1B" tokens).
_INT_SUFFIX = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


class ConfigError(HaloUserError, ValueError):
    """One or more config problems, each a ``(dotted_key, message)`` pair."""

    def __init__(self, problems: list[tuple[str, str]] | str):
        if isinstance(problems, str):
            problems = [("", problems)]
        self.problems = list(problems)
        super().__init__(self._render())

    def _render(self) -> str:
        lines = [f"{k}: {m}" if k else m for k, m in self.problems]
        if len(lines) == 1:
            return f"invalid config: {lines[0]}"
        return "invalid config:\n" + "\n".join(f"  - {line}" for line in lines)

    def prefixed(self, prefix: str) -> "ConfigError":
        """The same problems with ``prefix.`` in front of every key (errors bubble up a tree)."""
        return ConfigError([(join_key(prefix, k), m) for k, m in self.problems])


def join_key(prefix: str, key: str) -> str:
    """``join_key("optim", "lr") == "optim.lr"``; empty parts are dropped."""
    return ".".join(p for p in (prefix, str(key)) if p)


def fail(key: str, message: str) -> typing.NoReturn:
    """Raise a single-problem :class:`ConfigError` (used by the ``validate`` methods)."""
    raise ConfigError([(key, message)])


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Resolved type hints of a dataclass's init fields (cached: called once per section)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def build(cls: type, data: Any, path: str = "") -> Any:
    """Construct dataclass ``cls`` from a mapping, collecting every problem before raising."""
    if not isinstance(data, Mapping):
        fail(path, f"expected a mapping of {cls.__name__} keys, got {type(data).__name__}")
    types_ = field_types(cls)
    problems = [(join_key(path, k), UNKNOWN_KEY) for k in data if k not in types_]
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = join_key(path, f.name)
        if f.name in data:
            try:
                kwargs[f.name] = coerce(data[f.name], types_[f.name], key)
            except ConfigError as err:
                problems += err.problems
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            problems.append((key, "missing required key"))
    if problems:
        raise ConfigError(problems)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.prefixed(path) from None


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` converted to type ``tp`` or raise :class:`ConfigError` naming ``key``.

    Strings are accepted for every scalar type because dotlist overrides are strings and because
    YAML 1.1 reads ``1e-4`` (no dot) as a string.
    """
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return value if isinstance(value, tp) else build(tp, value, key)
    if origin in (Union, types.UnionType):
        return _coerce_union(value, typing.get_args(tp), key)
    if origin is Literal:
        return _coerce_literal(value, typing.get_args(tp), key)
    if origin in (list, tuple):
        return _coerce_sequence(value, tp, key)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            fail(key, f"expected a mapping, got {value!r}")
        return dict(value)
    scalar = _SCALARS.get(tp)
    if scalar is None:
        raise TypeError(f"{key}: unsupported config field type {tp!r}")
    return scalar(value, key)


def _coerce_union(value: Any, args: tuple, key: str) -> Any:
    """Optional[X] (the only union configs use): None / "none" / "null" map to None."""
    inner = [a for a in args if a is not type(None)]
    if len(inner) != 1:
        raise TypeError(f"{key}: only Optional[X] unions are supported, got {args}")
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE):
        return None
    return coerce(value, inner[0], key)


def _coerce_literal(value: Any, choices: tuple, key: str) -> Any:
    """Match by value, then by string form (so "3" selects the int choice 3 from a dotlist)."""
    for choice in choices:
        if value == choice and type(value) is type(choice):
            return choice
    for choice in choices:
        if not isinstance(value, bool) and str(value).strip() == str(choice):
            return choice
    shown = "|".join(str(c) for c in choices)
    hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    extra = f" (did you mean {hint[0]!r}?)" if hint else ""
    fail(key, f"must be one of {shown}, got {value!r}{extra}")


def _coerce_sequence(value: Any, tp: Any, key: str) -> list | tuple:
    """Lists from YAML lists or strings ``2,3,6`` / ``[2,3,6]``; tuples also check their length."""
    if isinstance(value, str):
        value = _parse_list_string(value, key)
    if not isinstance(value, (list, tuple)):
        fail(key, f"expected a list, got {value!r}")
    args = typing.get_args(tp)
    if typing.get_origin(tp) is list:
        return [coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    if len(value) != len(args):
        fail(key, f"expected {len(args)} values, got {len(value)}: {value!r}")
    return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))


def _parse_list_string(text: str, key: str) -> list:
    text = text.strip()
    if text.startswith("["):
        try:
            parsed = yaml.safe_load(text)
        except yaml.YAMLError as err:
            fail(key, f"cannot parse list {text!r}: {err}")
        return parsed if isinstance(parsed, list) else [parsed]
    return [part.strip() for part in text.split(",") if part.strip()]


def _to_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    fail(key, f"expected a boolean (true/false), got {value!r}")


def _to_int(value: Any, key: str) -> int:
    if isinstance(value, bool):
        fail(key, f"expected an integer, got boolean {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        parsed = _parse_int_string(value)
        if parsed is not None:
            return parsed
    fail(key, f"expected an integer, got {value!r}")


def _parse_int_string(text: str) -> int | None:
    """``"20000"``, ``"20_000"``, ``"1e9"``, ``"320M"``, ``"1B"`` -> int; None if not integral."""
    text = text.strip().lower().replace("_", "")
    scale = _INT_SUFFIX.get(text[-1:], 1) if text else 1
    if scale != 1:
        text = text[:-1]
    try:
        number = float(text) * scale
    except ValueError:
        return None
    return int(number) if number.is_integer() else None


def _to_float(value: Any, key: str) -> float:
    """A finite float: no config number means anything as inf or nan (an ``lr`` of inf trains
    non-finite weights, a nan passes every ``> 0`` check), so they are refused here, for every
    field."""
    if isinstance(value, bool):
        fail(key, f"expected a number, got boolean {value!r}")
    number = None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            pass
    if number is None:
        fail(key, f"expected a number, got {value!r}")
    if not math.isfinite(number):
        fail(key, f"must be a finite number, got {number}")
    return number


def _to_str(value: Any, key: str) -> str:
    if isinstance(value, str):
        return value
    fail(key, f"expected a string, got {value!r} (quote it in YAML)")


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def coerce_fields(obj: Any) -> None:
    """Coerce every field of dataclass ``obj`` in place (``__post_init__`` of every section)."""
    problems = []
    for name, tp in field_types(type(obj)).items():
        try:
            object.__setattr__(obj, name, coerce(getattr(obj, name), tp, name))
        except ConfigError as err:
            problems += err.problems
    if problems:
        raise ConfigError(problems)


def dotted_paths(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key a config class accepts, sections included (for suggestions)."""
    paths = []
    for name, tp in field_types(cls).items():
        key = join_key(prefix, name)
        paths.append(key)
        inner = _dataclass_in(tp)
        if inner is not None:
            paths += dotted_paths(inner, key)
    return paths


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass inside ``tp`` or ``Optional[tp]``, else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType):
        found = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        return found[0] if found else None
    return None


def suggest(bad_key: str, known: list[str]) -> str | None:
    """Closest known dotted key: a sibling first, then the same leaf in another section."""
    parent, _, leaf = bad_key.rpartition(".")
    siblings = [k for k in known if k.rpartition(".")[0] == parent]
    match = difflib.get_close_matches(bad_key, siblings, n=1, cutoff=0.6)
    if match:
        return match[0]
    # Right key, wrong section (e.g. "optim.warmup_steps" -> "schedule.warmup_steps").
    same_leaf = [k for k in known if k.rpartition(".")[2] == leaf]
    if same_leaf:
        return same_leaf[0]
    match = difflib.get_close_matches(bad_key, known, n=1, cutoff=0.75)
    return match[0] if match else None


def moved_to(key: str, moved: Mapping[str, str]) -> str | None:
    """Where ``key`` belongs when it, or a section above it, is in ``moved`` (old dotted key ->
    new)."""
    for old, new in moved.items():
        if key == old or key.startswith(old + "."):
            return new + key[len(old):]
    return None


def with_suggestions(err: ConfigError, root: type) -> ConfigError:
    """Add "did you mean" hints to the unknown-key problems of ``err``; a key that
    ``root.MOVED_KEYS`` places in another section is answered with its place there, one in
    ``root.REMOVED_KEYS`` with what to do instead."""
    known = dotted_paths(root)
    moved = getattr(root, "MOVED_KEYS", {})
    removed = getattr(root, "REMOVED_KEYS", {})
    problems = []
    for key, message in err.problems:
        if message == UNKNOWN_KEY and key in removed:
            message = f"{UNKNOWN_KEY}: {key} was removed; {removed[key]}"
        elif message == UNKNOWN_KEY:
            new = moved_to(key, moved)
            hint = None if new else suggest(key, known)
            if new:
                message = f"{UNKNOWN_KEY}: {key} moved to {new}"
            elif hint:
                message = f"{UNKNOWN_KEY} (did you mean {hint!r}?)"
        problems.append((key, message))
    return ConfigError(problems)


def from_dict(cls: type, data: Mapping) -> Any:
    """Build the root config ``cls`` from a mapping; errors carry full paths and suggestions."""
    try:
        return build(cls, data)
    except ConfigError as err:
        raise with_suggestions(err, cls) from None


def check_partial(cls: type, data: Any, path: str = "") -> list[tuple[str, str]]:
    """Problems in a partial tree (a ``base`` file): unknown keys and bad values, not missing keys.

    Nested sections are walked without being constructed, so their required keys may be absent.
    """
    if not isinstance(data, Mapping):
        return [(path, f"expected a mapping of {cls.__name__} keys, got {type(data).__name__}")]
    types_, problems = field_types(cls), []
    for key, value in data.items():
        full = join_key(path, key)
        if key not in types_:
            problems.append((full, UNKNOWN_KEY))
        elif isinstance(value, Mapping) and _dataclass_in(types_[key]) is not None:
            problems += check_partial(_dataclass_in(types_[key]), value, full)
        else:
            try:
                coerce(value, types_[key], full)
            except ConfigError as err:
                problems += err.problems
    return problems


def to_dict(obj: Any) -> Any:
    """Plain YAML-safe data (dicts, lists, scalars) from a config dataclass tree."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
