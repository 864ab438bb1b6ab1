"""YAML files with ``base:`` inheritance, plus ``key.sub=value`` dotlist overrides.

Resolution order (later wins): the ``base`` files (in list order, each resolved recursively),
the file itself, then the command-line overrides. Mappings merge key by key; any other value,
lists included, is replaced whole. ``base`` paths are relative to the file that names them; every
other path in a config is used as written (relative to the working directory).
"""
from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .coerce import ConfigError, check_partial, from_dict, to_dict, with_suggestions
from .schema import RunConfig

T = TypeVar("T")
BASE_KEY = "base"
# A file written by save_resolved: {"meta": {...}, "config": {...}}; loading it re-runs the config.
RESOLVED_KEYS = {"meta", "config"}


def read_yaml(path: str | Path) -> dict[str, Any]:
    """One YAML file as a mapping (``safe_load``: tags that would build objects are refused; a key
    given twice in one mapping is refused, where YAML would silently keep the last)."""
    path = Path(path)
    text = _read_text(path)
    try:
        _refuse_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), path)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a directory, not a YAML config file: name the file, e.g. "
                          f"{path / 'stage2.yaml'}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                          f"{err.start}): is it a YAML config? Configs are UTF-8 YAML "
                          "files") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror or err}") from None


def _refuse_duplicate_keys(node: yaml.Node | None, path: Path, prefix: str = "") -> None:
    """Refuse a mapping that names a key twice, with the dotted key and both lines."""
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicate_keys(item, path, prefix)
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
            continue
        key = f"{prefix}.{key_node.value}" if prefix else key_node.value
        line = key_node.start_mark.line + 1
        if key in seen:
            raise ConfigError(f"{path}: {key} is given twice (lines {seen[key]} and {line}); YAML "
                              "keeps only the last, silently: remove one")
        seen[key] = line
        _refuse_duplicate_keys(value_node, path, key)


def load_tree(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The merged raw mapping of ``path`` and its ``base`` files (not yet typed)."""
    return _load_tree_and_origins(path, _chain)[0]


def _load_tree_and_origins(path: str | Path,
                           _chain: tuple[Path, ...] = ()) -> tuple[dict[str, Any], dict[str, Path]]:
    """``load_tree`` plus, for every dotted key, the file whose value won (errors name that
    file)."""
    path = Path(path).resolve()
    if path in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, path))
        raise ConfigError(f"base files include each other: {cycle}")
    data = read_yaml(path)
    if set(data) == RESOLVED_KEYS:
        return data["config"], {}
    merged: dict[str, Any] = {}
    origins: dict[str, Path] = {}
    for base in _base_list(data.pop(BASE_KEY, None), path):
        base_path = path.parent / base
        if not base_path.is_file():
            raise ConfigError(f"{path}: base file not found: {base} (looked at {base_path})")
        tree, base_origins = _load_tree_and_origins(base_path, (*_chain, path))
        merged = deep_merge(merged, tree)
        origins.update(base_origins)
    origins.update(dict.fromkeys(_dotted_keys(data), path))
    return deep_merge(merged, data), origins


def _dotted_keys(tree: Mapping, prefix: str = "") -> list[str]:
    keys = []
    for key, value in tree.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        keys.append(full)
        if isinstance(value, Mapping):
            keys += _dotted_keys(value, full)
    return keys


def _name_base_files(err: ConfigError, origins: Mapping[str, Path], top: Path,
                     overridden: Iterable[str] = ()) -> ConfigError:
    """``err`` with each problem that comes from a ``base`` file (not ``top``, not an override)
    naming it: a typo three files down is otherwise reported as if it were in the file the user
    gave."""
    overridden = tuple(overridden)
    problems = []
    for key, message in err.problems:
        origin = origins.get(key)
        from_override = any(key == o or key.startswith(o + ".") for o in overridden)
        if origin is not None and origin != top and not from_override:
            message = f"{message} (in base file {_shown(origin)})"
        problems.append((key, message))
    return ConfigError(problems)


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it is under it (as users type config
    paths)."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _base_list(value: Any, path: Path) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise ConfigError(f"{path}: '{BASE_KEY}' must be a path or a list of paths, got {value!r}")


def deep_merge(base: Mapping, top: Mapping) -> dict:
    """``top`` over ``base``: mappings merge recursively, everything else is replaced."""
    out = copy.deepcopy(dict(base))
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_override(text: str) -> tuple[str, str]:
    """``"optim.lr=3e-4"`` -> ``("optim.lr", "3e-4")``; the value stays a string until typed."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    return key, value.strip()


def apply_overrides(tree: Mapping, overrides: Iterable[str] | Mapping[str, Any]) -> dict:
    """A copy of ``tree`` with dotted-key overrides set (strings or already-typed values)."""
    items = overrides.items() if isinstance(overrides, Mapping) else map(parse_override, overrides)
    out = copy.deepcopy(dict(tree))
    for key, value in items:
        _set_dotted(out, key, value)
    return out


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = tree
    for i, part in enumerate(parents):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError([(".".join(parents[: i + 1]),
                                f"is a value, not a section (override {key}={value!r})")])
        node = child
    node[leaf] = value


def config_from_dict(data: Mapping, overrides: Iterable[str] | Mapping[str, Any] = (),
                     cls: type[T] = RunConfig) -> T:
    """Typed, validated config from a raw mapping plus overrides."""
    return from_dict(cls, apply_overrides(data, overrides))


def load_config(path: str | Path, overrides: Iterable[str] | Mapping[str, Any] = (),
                cls: type[T] = RunConfig) -> T:
    """Load ``path`` (with its bases), apply ``key=value`` overrides, type and validate.

    Raises :class:`ConfigError` listing every problem: unknown keys (with the dotted path and a
    "did you mean"), bad types, and impossible combinations.
    """
    tree, origins = _load_tree_and_origins(path)
    overrides = dict(overrides) if isinstance(overrides, Mapping) else list(overrides)  # read twice
    keys = overrides if isinstance(overrides, dict) else [parse_override(o)[0] for o in overrides]
    try:
        return config_from_dict(tree, overrides, cls)
    except ConfigError as err:
        raise _name_base_files(err, origins, Path(path).resolve(), keys) from None


def with_overrides(cfg: T, overrides: Iterable[str] | Mapping[str, Any]) -> T:
    """A re-validated copy of ``cfg`` with overrides (configs are frozen: change them this way)."""
    return config_from_dict(to_dict(cfg), overrides, type(cfg))


def validate_file(path: str | Path, cls: type[T] = RunConfig) -> T | None:
    """Check any shipped YAML: a full run config (it names a ``stage``) is loaded and returned;
    a partial one (a ``base`` file) is checked for unknown keys and bad values, returning None.
    """
    tree, origins = _load_tree_and_origins(path)
    try:
        if "stage" in tree:
            return config_from_dict(tree, (), cls)
        problems = check_partial(cls, tree)
        if problems:
            raise with_suggestions(ConfigError(problems), cls)
    except ConfigError as err:
        raise _name_base_files(err, origins, Path(path).resolve()) from None
    return None
