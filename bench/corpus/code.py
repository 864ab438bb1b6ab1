"""Which Python files become code documents: this interpreter's code folders, the ``.py`` files
under a folder, and the files skipped (too big, not UTF-8, minified, generated data)."""

from __future__ import annotations

import os
import re
import site
import sysconfig
from pathlib import Path
from typing import Iterator

CODE_MAX_FILE_BYTES = 300_000


def code_roots() -> list[tuple[Path, str | None]]:
    """(folder, source tag or None = one tag per top-level package) of this interpreter's Python
    code: the standard library (one ``code:stdlib`` tag) and every site-packages folder."""
    paths = sysconfig.get_paths()
    roots, seen = [], set()
    sites = [paths["purelib"], paths["platlib"], *site.getsitepackages()]
    for p, tag in [(paths["stdlib"], "code:stdlib")] + [(q, None) for q in sites]:
        rp = os.path.realpath(p)
        if os.path.isdir(rp) and rp not in seen:
            seen.add(rp)
            roots.append((Path(rp), tag))
    return roots


NOT_CODE_DIRS = {"__pycache__", "site-packages", "dist-packages", "node_modules", ".git"}


def iter_code_files(folder: Path) -> Iterator[Path]:
    """``.py`` files under ``folder`` in sorted path order (bytecode caches, nested site-packages,
    metadata folders skipped)."""
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(
            d for d in dirnames if d not in NOT_CODE_DIRS and not d.endswith((".dist-info",
                                                                               ".egg-info")))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


_LITERAL_LINE = re.compile(r"""^\s*(?:[-+]?\(?\d[\w.]*|[bru]?'[^']*'|[bru]?"[^"]*")\s*[:,)]""")


def read_code(path: Path) -> tuple[str | None, str]:
    """(source text, "") or (None, why it is skipped): too big, not UTF-8, minified or generated
    data."""
    try:
        if path.stat().st_size > CODE_MAX_FILE_BYTES:
            return None, "too_big"
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None, "not_utf8"
    except OSError:
        return None, "unreadable"
    if not text.strip():
        return None, "empty"
    lines = text.splitlines()
    if max(map(len, lines)) > 1000 or len(text) / len(lines) > 100:
        return None, "long_lines"
    body = re.sub(r"\s", "", text)
    if sum(c.isdigit() for c in body) > 0.3 * len(body):  # tables of numbers (unicode data, fonts)
        return None, "numeric_data"
    lines = [ln for ln in lines if ln.strip()]
    # generated tables (chardet's language models, SPDX ids, emoji codes); an __all__ list stays
    # below
    if sum(1 for ln in lines if _LITERAL_LINE.match(ln)) > 0.8 * len(lines):
        return None, "literal_data"
    return text, ""
