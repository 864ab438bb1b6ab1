"""Shared helpers for the data-pipeline tests (tests/test_data_*.py): small cached corpora."""
from __future__ import annotations

import argparse
import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import torch

torch.set_num_threads(1)

# configs/tiny's vocabulary (halo_dist.assets.tokenizer): shards the tiny models can embed. The
# data-pipeline tests keep the real Qwen tokenizer (run_prep's default).
TINY_TOKENIZER = "offline-wiki-bpe4k"

_TMP = Path(tempfile.mkdtemp(prefix="halo_data_tests-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)


@functools.cache
def qwen_tokenizer():
    """The offline Qwen3 tokenizer (built once into the halo_dist cache)."""
    from halo_dist.assets.tokenizer import load_qwen_tokenizer

    return load_qwen_tokenizer()


@functools.cache
def small_tokenizer():
    """configs/tiny's tokenizer: a 4,096-token BPE trained on the offline Wikipedia extracts."""
    from halo_dist.assets.tokenizer import load_small_tokenizer

    return load_small_tokenizer()


@functools.cache
def wiki_docs(n: int = 400) -> tuple[str, ...]:
    from halo_dist.assets.text import iter_wiki_texts

    return tuple(iter_wiki_texts(limit=n))


def write_jsonl(path: Path, texts) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return path


def prep_args(out, **kw) -> argparse.Namespace:
    """Parsed ``data_prep.tokenize`` arguments with test-friendly defaults, overridden by ``kw``."""
    from data_prep.tokenize import build_parser

    argv = ["--out", str(out), "--tokenizer", "offline-qwen3", "--no-progress", "--num-proc", "1",
            "--wiki-offline"]  # the source is overridden by input=... / hf_dataset=... in kw
    ns = build_parser().parse_args(argv)
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def run_prep(out, **kw) -> dict:
    from data_prep.tokenize import run

    return run(prep_args(out, **kw))


@functools.cache
def wiki_dataset(n_docs: int = 400, shard_tokens: int = 5000, heldout: float = 0.05) -> Path:
    """Manifest folder of the first ``n_docs`` Wikipedia extracts (Qwen tokens, ~9 train shards)."""
    out = _TMP / f"wiki-{n_docs}-{shard_tokens}-{heldout}"
    run_prep(out, max_docs=n_docs, shard_tokens=shard_tokens, heldout_fraction=heldout)
    return out


def copy_dataset(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def tmpdir(name: str) -> Path:
    p = Path(tempfile.mkdtemp(prefix=name, dir=_TMP))
    return p
