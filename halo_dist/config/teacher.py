"""Offline checks of a teacher against a config, cheap enough for the Slurm driver (no torch
import)."""

from __future__ import annotations

import json
from pathlib import Path


def offline_teacher_depth(teacher: str) -> int | None:
    """``num_hidden_layers`` of a teacher folder or of a hub id already in the HF cache; None when
    that needs the network (or a GGUF teacher). For checks that must not download (the Slurm
    driver)."""
    path = Path(teacher) / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return None
        try:
            cached = try_to_load_from_cache(teacher, "config.json")
        except ValueError:  # not a valid repo id
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    layers = json.loads(path.read_text()).get("num_hidden_layers")
    return int(layers) if layers is not None else None


def teacher_depth_problem(teacher: str, num_layers: int | None) -> str | None:
    """Why ``teacher`` cannot be the teacher of a config sized for ``num_layers`` layers, or None
    (it matches, or its depth cannot be read offline)."""
    depth = offline_teacher_depth(teacher)
    if depth is None or num_layers is None or depth == num_layers:
        return None
    return (f"teacher {teacher} has {depth} layers but the stage configs are sized for a "
            f"{num_layers}-layer teacher (model.num_layers, model.attn_layers): use the matching "
            "slurm/halo_<size>.sh")


def is_hub_id(name: str) -> bool:
    """``org/name`` (or ``name``) that is not a local path: what transformers would fetch from the
    hub (``models.convert.resolve_teacher`` draws the same line)."""
    return (not Path(name).exists() and not name.startswith((".", "/", "~"))
            and name.count("/") <= 1)


def source_problem(key: str, name: str, needs: str = "config.json") -> str | None:
    """Why the model or tokenizer source ``name`` (config key ``key``) cannot be read here, or
    None: a local path that does not exist, or a hub id that is not in the Hugging Face cache while
    the hub is offline (``needs``: the file the loader reads first). Online, a hub id is left to
    the download."""
    if not is_hub_id(name):
        return None if Path(name).expanduser().exists() else f"{key}: {name} does not exist"
    try:
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:
        return None
    if not constants.HF_HUB_OFFLINE:
        return None
    try:
        cached = try_to_load_from_cache(name, needs)
    except ValueError:  # not a valid repo id either
        return f"{key}: {name} is neither a local path nor a hub id"
    if isinstance(cached, str):
        return None
    return (f"{key}: {name} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the "
            "hub is offline (HF_HUB_OFFLINE=1): download it where there is network "
            f"(`hf download {name}`, with HF_HOME shared with this machine) or point {key} at a "
            "local folder")
