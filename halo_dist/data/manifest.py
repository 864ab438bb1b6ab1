"""``manifest.json`` of a tokenized data set: reading, validation, tokenizer identity.

Layout (written by ``python -m data_prep.tokenize``)::

    {"format": "halo_dist.tokens/v1", "complete": true, "dtype": "uint32",
     "tokenizer": {"name", "class", "vocab_size", "vocab_sha256", "eos_id", "eos_token"},
     "source": {...}, "args": {...}, "config": {...}, "resume": {...},
     "splits": {"train":   {"shards": [{"path": "train/shard-000000.tar", "samples", "docs",
                                       "tokens", "bytes", "sha256", "first_doc", "last_doc"}, ...],
                            "samples", "docs", "tokens"},
                "heldout": {...}},
     "totals": {"docs", "samples", "tokens", "shards", "skipped_empty_docs", ...}}

Shard paths are relative to the manifest's folder.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import DataError

FORMAT = "halo_dist.tokens/v1"
MANIFEST_NAME = "manifest.json"
_SHARD_KEYS = ("path", "samples", "tokens", "bytes", "sha256")


@dataclass
class ShardInfo:
    """One shard as the manifest (or a scan) describes it; unknown fields are None. ``dtype`` and
    ``vocab_sha256``: what the manifest says every shard of it holds (its token dtype and its
    tokenizer's vocabulary), checked against the shard's own header (``shards.read_shard_header``)
    when it is used."""

    path: str
    samples: int | None = None
    tokens: int | None = None
    bytes: int | None = None
    sha256: str | None = None
    docs: int | None = None
    dtype: str | None = None
    vocab_sha256: str | None = None


@dataclass
class Manifest:
    """A parsed manifest restricted to one split (or a bare shard list with ``path=None``)."""

    path: str | None
    split: str
    shards: list[ShardInfo]
    tokenizer: dict = field(default_factory=dict)
    dtype: str | None = None
    raw: dict = field(default_factory=dict)

    def fingerprint(self) -> str:
        """Hash of what defines the token stream: shard paths, counts and checksums."""
        h = hashlib.sha256()
        for s in self.shards:
            h.update(f"{os.path.basename(s.path)}|{s.samples}|{s.tokens}|{s.sha256}\n".encode())
        return h.hexdigest()[:32]


def _require(obj: dict, key: str, typ, path, where: str):
    if key not in obj:
        raise DataError(f"manifest is missing '{where}{key}'", path, f"{where}{key}")
    val = obj[key]
    if not isinstance(val, typ) or isinstance(val, bool) and typ is not bool:
        raise DataError(f"manifest field '{where}{key}' has the wrong type ({type(val).__name__})",
                        path, f"{where}{key}")
    return val


def read_manifest_json(path: str | os.PathLike) -> dict:
    """Load a manifest file as a dict (DataError naming the file if missing or not JSON)."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError("manifest not found", path) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"manifest is not valid JSON ({e})", path) from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise DataError(f"not a {FORMAT} manifest", path, "format")
    return raw


def load_manifest(path: str | os.PathLike, split: str = "train",
                  allow_incomplete: bool = False) -> Manifest:
    """Parse and validate ``path`` (a manifest file or its folder) for ``split``."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    raw = read_manifest_json(path)
    if not raw.get("complete", False) and not allow_incomplete:
        raise DataError("manifest is incomplete (data_prep did not finish; re-run it to resume)",
                        path, "complete")
    splits = _require(raw, "splits", dict, path, "")
    if split not in splits:
        raise DataError(f"split '{split}' not in manifest (has {sorted(splits)})", path,
                        f"splits.{split}")
    where = f"splits.{split}."
    entries = _require(splits[split], "shards", list, path, where)
    if not entries:
        raise DataError(f"split '{split}' has no shards", path, f"{where}shards")
    tokenizer = raw.get("tokenizer") if isinstance(raw.get("tokenizer"), dict) else {}
    vocab = tokenizer.get("vocab_sha256")
    shards = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise DataError("shard entry is not an object", path, f"{where}shards[{i}]")
        for k in _SHARD_KEYS:
            _require(e, k, str if k in ("path", "sha256") else int, path, f"{where}shards[{i}].")
        shards.append(ShardInfo(str(path.parent / e["path"]), e["samples"], e["tokens"], e["bytes"],
                                e["sha256"], e.get("docs"), raw.get("dtype"), vocab))
    return Manifest(str(path), split, shards, tokenizer, raw.get("dtype"), raw)


def refuse_duplicates(shards: list[ShardInfo], where: object = None) -> None:
    """A shard listed twice, under its own name or as a copy (the same sha256), would be trained on
    twice per epoch: refused, naming both."""
    seen: dict[object, str] = {}
    for s in shards:
        keys = [("path", os.path.realpath(s.path))] + ([("sha256", s.sha256)] if s.sha256 else [])
        for kind, key in keys:
            if (kind, key) in seen:
                how = ("listed twice" if kind == "path" else
                       f"listed twice: a copy of {seen[(kind, key)]} (the same sha256)")
                raise DataError(f"shard {s.path} is {how}; its tokens would be trained on twice "
                                "per epoch: drop one", where or s.path, "shards")
            seen[(kind, key)] = s.path


def vocab_sha256(tokenizer) -> str:
    """sha256 over the tokenizer's full vocabulary (``token\\tid`` lines sorted by id, added tokens
    included).

    Memoised on the tokenizer object (computing it takes ~0.3 s for a 152K vocabulary).
    """
    cached = getattr(tokenizer, "_halo_vocab_sha256", None)
    if cached is not None and cached[0] == len(tokenizer):  # recomputed if tokens were added since
        return cached[1]
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256()
    for tok, idx in sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])):
        h.update(f"{tok}\t{idx}\n".encode("utf-8", "surrogatepass"))
    digest = h.hexdigest()
    try:
        tokenizer._halo_vocab_sha256 = (len(tokenizer), digest)
        tokenizer._halo_vocab_size = len(vocab)
    except AttributeError:
        pass
    return digest


def _vocab_size(tokenizer) -> int:
    vocab_sha256(tokenizer)
    return getattr(tokenizer, "_halo_vocab_size", None) or len(tokenizer.get_vocab())


def tokenizer_info(tokenizer, eos_id: int) -> dict:
    """Identity of ``tokenizer`` as stored in the manifest."""
    return {"name": getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__,
            "class": type(tokenizer).__name__,
            "vocab_size": _vocab_size(tokenizer),
            "vocab_sha256": vocab_sha256(tokenizer),
            "eos_id": int(eos_id),
            "eos_token": tokenizer.convert_ids_to_tokens(int(eos_id))}


def check_tokenizer(manifest, tokenizer, eos_id: int | None = None) -> dict:
    """Refuse shards tokenized with a different tokenizer than ``tokenizer``.

    Args:
        manifest: a :class:`Manifest`, a manifest path, or a folder holding ``manifest.json``.
        tokenizer: a HF tokenizer (anything with ``get_vocab()``). eos_id: the EOS id the model
        expects between documents; when given it must equal the manifest's.
    Returns: the manifest's tokenizer record.
    Raises: DataError naming the manifest and the disagreeing key (``tokenizer.vocab_sha256`` ...).
    """
    if isinstance(manifest, Manifest):
        raw, mpath = manifest.raw, manifest.path
    else:
        p = Path(manifest)
        mpath = p / MANIFEST_NAME if p.is_dir() else p
        raw = read_manifest_json(mpath)
    rec = raw.get("tokenizer")
    if not isinstance(rec, dict) or "vocab_sha256" not in rec:
        raise DataError("manifest records no tokenizer", mpath, "tokenizer.vocab_sha256")
    mine = vocab_sha256(tokenizer)
    if rec["vocab_sha256"] != mine:
        raise DataError(f"tokenizer mismatch: shards were tokenized with '{rec.get('name')}' "
                        f"(vocab {rec.get('vocab_size')}, sha256 {rec['vocab_sha256'][:12]}…), the "
                        f"model's tokenizer '{getattr(tokenizer, 'name_or_path', '?')}' has vocab "
                        f"{_vocab_size(tokenizer)}, sha256 {mine[:12]}…", mpath,
                        "tokenizer.vocab_sha256")
    if eos_id is not None and int(rec.get("eos_id", -1)) != int(eos_id):
        raise DataError(f"EOS mismatch: shards use EOS id {rec.get('eos_id')}, the model expects "
                        f"{eos_id}", mpath, "tokenizer.eos_id")
    return rec
