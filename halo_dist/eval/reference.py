"""Reference figures: a model's evaluation computed once and reused while nothing it depends on
changes.

Every conversion of one teacher evaluates that teacher with the same harness; on a GPU that is
minutes per run (the teacher's 64K NIAH prompts alone), and the figures cannot differ. ``eval-suite
--reference-cache DIR`` keeps each part's result file (NIAH, CSR, perplexity) under a key made of
everything the figures depend on:

- the harness (``niah.HARNESS_VERSION``: templates, haystacks, scoring) and the library versions
  that compute the numbers (torch, transformers, lm-eval: major.minor);
- the model: a hash of every file of its folder (weights, config, tokenizer);
- the part's settings (lengths, depths, prompts per cell, tasks, item limits, batch sizes, the
  held-out split's fingerprint, sequence length, rows), the dtype and the device type.

A change to any of them is a different key, so a stale figure is never a hit; a miss simply
evaluates again. Keys are long hex digests; files are written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from .errors import EvalError


def model_identity(folder: str | os.PathLike) -> str:
    """sha256 over every regular file directly in ``folder`` (name and content), except the model
    card and our provenance notes, which do not change what the model computes."""
    folder = Path(folder)
    if not folder.is_dir():
        raise EvalError(f"{folder}: not a model folder (reference figures need its files)")
    h = hashlib.sha256()
    for f in sorted(p for p in folder.iterdir() if p.is_file()):
        if f.name in ("README.md", "halo_dist.json") or f.name.startswith("."):
            continue
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as src:
            for block in iter(lambda: src.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def library_versions() -> dict:
    """major.minor of the libraries whose kernels and scoring produce the figures."""
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "lm_eval"):
        try:
            out[name] = ".".join(md.version(name.replace("_", "-")).split(".")[:2])
        except md.PackageNotFoundError:
            out[name] = None
    return out


def part_key(part: str, model_id: str, settings: dict) -> str:
    """The key of one part's figures: the part, the harness, the model and the settings."""
    from .niah import HARNESS_VERSION

    spec = {"part": part, "harness": HARNESS_VERSION, "libraries": library_versions(),
            "model": model_id, "settings": settings}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()


class ReferenceCache:
    """``<folder>/<part>-<key>.json``: one part's result file as ``eval-suite`` writes it."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)

    def path(self, part: str, key: str) -> Path:
        return self.folder / f"{part}-{key[:24]}.json"

    def fetch(self, part: str, key: str, target: Path) -> bool:
        """Copy the cached result to ``target`` if there is one; True on a hit."""
        src = self.path(part, key)
        if not src.exists():
            return False
        _copy_atomic(src, target)
        return True

    def store(self, part: str, key: str, result: Path) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        dst = self.path(part, key)
        _copy_atomic(result, dst)
        return dst


def _copy_atomic(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
