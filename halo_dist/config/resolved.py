"""The resolved config: pretty printing (``--dry-run``), saving with provenance, loading back.

A resolved file is ``{"meta": {...}, "config": {...}}``: ``config`` holds every field (defaults
included), so a later reader never depends on today's defaults; ``meta`` records the git commit and
the command line that produced it. ``load_config`` accepts such a file too, to re-run a run.
"""
from __future__ import annotations

import datetime
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from .coerce import ConfigError, from_dict, to_dict
from .loader import RESOLVED_KEYS, read_yaml, with_overrides
from .schema import RunConfig

_REPO_ROOT = Path(__file__).resolve().parents[2]


class _Dumper(yaml.SafeDumper):
    """Block-style sections, inline lists of scalars (``attn_layers: [2, 3, 6]``)."""


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flat = all(not isinstance(v, (list, dict)) for v in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


_Dumper.add_representer(list, _represent_list)


def dump_yaml(data: Any) -> str:
    """YAML text of plain data, keys in insertion (declaration) order."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)


def format_config(cfg: Any) -> str:
    """The config as YAML, fields in declaration order, short lists inline."""
    return dump_yaml(to_dict(cfg))


def _fit_note(cfg: RunConfig, fitted: RunConfig, world_size: int) -> str:
    return (f"data.fit_micro_batch: micro batch {cfg.data.micro_batch_size} "
            f"-> {fitted.data.micro_batch_size} "
            f"on {world_size} ranks (global batch {cfg.data.global_batch_size} unchanged)")


def fit_to_world(cfg: RunConfig, world_size: int, announce: bool = False) -> RunConfig:
    """``cfg`` with its micro batch fitted to ``world_size`` (``data.fit_micro_batch``; ``cfg``
    itself when it already fits); says so if ``announce``."""
    micro = cfg.fitted_micro_batch(world_size)
    fitted = (cfg if micro == cfg.data.micro_batch_size
              else with_overrides(cfg, {"data.micro_batch_size": micro}))
    if announce and fitted is not cfg:
        print(_fit_note(cfg, fitted, world_size), flush=True)
    return fitted


def describe(cfg: RunConfig, world_size: Optional[int] = None) -> str:
    """What ``--dry-run`` prints: the resolved YAML plus the derived run length and batch layout."""
    lines = [format_config(cfg).rstrip(), "# derived:",
             f"#   tokens per step: {cfg.tokens_per_step:,}",
             f"#   total steps:     {cfg.total_steps:,} "
             f"({cfg.total_steps * cfg.tokens_per_step:,} tokens)",
             f"#   checkpoint dir:  {cfg.checkpoint_dir}"]
    if world_size is not None:
        fitted = fit_to_world(cfg, world_size)
        if fitted is not cfg:
            lines.append(f"#   {_fit_note(cfg, fitted, world_size)}")
        layout = fitted.validate_against_world(world_size)
        lines.append(f"#   world {layout.world_size} = dp {layout.dp_size} x sp {layout.sp_size}; "
                     f"global batch {layout.global_batch_size} = micro {layout.micro_batch_size} "
                     f"x grad_accum {layout.grad_accum_steps} x dp {layout.dp_size}")
    return "\n".join(lines) + "\n"


def git_info(repo: Path = _REPO_ROOT) -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": bool or None}`` of the code that is running."""
    commit = _git(repo, "rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = _git(repo, "status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def _git(repo: Path, *args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                             timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None  # not a git checkout, no commits yet, or git missing: provenance is optional
    return out.stdout.strip()


def save_resolved(cfg: RunConfig, path: str | Path, argv: Optional[Sequence[str]] = None) -> Path:
    """Write ``cfg`` with its git commit and command line to ``path`` atomically; return the path.

    Call it on rank 0 only. ``argv`` defaults to ``sys.argv``.
    """
    path = Path(path)
    meta = {"git": git_info(), "command": shlex.join(sys.argv if argv is None else argv),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    text = dump_yaml({"meta": meta, "config": to_dict(cfg)})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    header = "# halo_dist resolved config (load with halo_dist.config.load_resolved)\n"
    tmp.write_text(header + text)
    os.replace(tmp, path)  # readers never see a half-written file
    return path


def _resolved_data(path: str | Path) -> dict[str, Any]:
    data = read_yaml(path)
    if set(data) != RESOLVED_KEYS:
        raise ConfigError(f"{path}: not a resolved config (expected keys meta and config)")
    return data


def load_resolved(path: str | Path, cls: type = RunConfig) -> RunConfig:
    """The config saved by :func:`save_resolved` (validated again)."""
    return from_dict(cls, _resolved_data(path)["config"])


def read_resolved_meta(path: str | Path) -> dict[str, Any]:
    """The provenance block (git commit, command, creation time) of a resolved config."""
    return _resolved_data(path)["meta"]
