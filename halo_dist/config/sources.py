"""Whether a model or tokenizer source named in a config (a local path or a hub id) can be read
here, checked before anything is loaded (no torch import). The teacher's own checks are in
``halo_dist.teacher``."""

from __future__ import annotations

from pathlib import Path


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
