"""The DeepSpeed config dict, built from the RunConfig with a JSON file merged over it.

The RunConfig is the single source of the values it owns (batch sizes, clipping, precision, ZeRO
stage): they are derived here, and a JSON under ``configs/deepspeed/`` may only add tuning
(bucket sizes, prefetching, overlap). A JSON that sets an owned key to a different value is an
error rather than a silent winner. Keys starting with ``_`` are comments and are dropped. The
optimizer and scheduler are built by the engine (fused torch AdamW, ``schedules.LRSchedule``), so
JSON ``optimizer``/``scheduler`` blocks are refused.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from .coerce import ConfigError
from .loader import deep_merge
from .schema import BatchLayout, RunConfig

_FORBIDDEN = {"optimizer": "the engine builds fused AdamW from the optim section",
              "scheduler": "the engine builds the LR schedule from the schedule section"}


def owned_deepspeed_keys(cfg: RunConfig, layout: BatchLayout) -> dict[str, Any]:
    """The DeepSpeed keys whose values come from the RunConfig."""
    return {
        "train_batch_size": layout.global_batch_size,
        "train_micro_batch_size_per_gpu": layout.micro_batch_size,
        "gradient_accumulation_steps": layout.grad_accum_steps,
        "gradient_clipping": cfg.optim.grad_clip or 0.0,
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
        "zero_optimization": {"stage": cfg.parallel.zero_stage},
        "steps_per_print": 2**31 - 1,  # halo_dist's metrics layer does the logging
    }


def read_deepspeed_json(path: str | Path) -> dict[str, Any]:
    """A DeepSpeed JSON with ``_comment``-style keys removed (at every level)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError([("parallel.deepspeed_config", f"file not found: {path}")]) from None
    except json.JSONDecodeError as err:
        raise ConfigError([("parallel.deepspeed_config", f"{path}: invalid JSON: {err}")]) from None
    return _drop_comments(data)


def _drop_comments(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _drop_comments(v) for k, v in data.items() if not str(k).startswith("_")}
    return data


def deepspeed_config(cfg: RunConfig, layout: BatchLayout,
                     overrides: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Owned keys from ``cfg`` with ``overrides`` (default: ``parallel.deepspeed_config``)
    merged."""
    if overrides is None:
        path = cfg.parallel.deepspeed_config
        overrides = read_deepspeed_json(path) if path else {}
    owned = owned_deepspeed_keys(cfg, layout)
    problems = [(f"deepspeed.{k}", why) for k, why in _FORBIDDEN.items() if k in overrides]
    problems += _conflicts(owned, overrides, "deepspeed")
    if problems:
        raise ConfigError(problems)
    return deep_merge(owned, overrides)


def _conflicts(owned: dict, extra: dict, prefix: str) -> list[tuple[str, str]]:
    """Leaves of ``extra`` that set an owned key to a different value."""
    found = []
    for key, value in extra.items():
        if key not in owned:
            continue
        mine, path = owned[key], f"{prefix}.{key}"
        if isinstance(mine, dict) and isinstance(value, dict):
            found += _conflicts(mine, value, path)
        elif mine != value:
            found.append((path, f"JSON sets {value!r} but the run config gives {mine!r}; "
                                "change the run config instead"))
    return found
