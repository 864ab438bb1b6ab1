"""Every natural-text source, in priority order, with the Debian packages it reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bench.corpus.dictionaries import (clean_dictd, clean_gcide, dictd_entries, read_bible,
                                       wordnet_synsets)
from bench.corpus.documents import require_dir
from bench.corpus.html_docs import debian_handbook, debian_reference, postgresql_docs, python_docs
from bench.corpus.manuals import info_manuals, man_pages, usr_share_doc


def wiki_extracts() -> list[str]:
    from halo_dist.assets.text import wiki_documents

    return [f"{d['title']}\n\n{d['text']}" for d in wiki_documents()]


def dictd(name: str, clean: Callable[[str], str]) -> Callable[[], list[str]]:
    def read() -> list[str]:
        root = Path("/usr/share/dictd")
        return [clean(e) for e in dictd_entries(root / f"{name}.index", root / f"{name}.dict.dz")]
    return read


def wordnet() -> list[str]:
    root = require_dir(Path("/usr/share/wordnet"))
    return [ln for part in ("noun", "verb", "adj", "adv")
            for ln in wordnet_synsets(root / f"data.{part}")]


@dataclass(frozen=True)
class Source:
    """A natural-text source: its tag, the Debian packages it reads, and how its records are
    read."""

    name: str
    packages: tuple[str, ...]
    read: Callable[[], list[str]]
    group: bool  # tiny records (entries, synsets, pages) -> ~80K-character documents


def natural_sources(workers: int = 2) -> list[Source]:
    """Every natural-text source, highest priority first."""
    # other sources' folders
    claimed = ("python3.11/html", "debian-handbook", "postgresql-doc-", "debian-reference")
    return [
        Source("wiki", (), wiki_extracts, True),
        Source("python-docs", ("python3.11-doc",), python_docs, True),
        Source("debian-reference", ("debian-reference-en",), debian_reference, True),
        Source("debian-handbook", ("debian-handbook",), debian_handbook, True),
        Source("bible", ("bible-kjv-text", "bible-kjv"), read_bible, False),
        Source("wordnet", ("wordnet-base",), wordnet, True),
        Source("man", ("man-db", "groff-base", "manpages", "manpages-dev", "perl-doc"),
               lambda: man_pages(workers), False),
        Source("info", ("autoconf-doc", "gettext-doc", "gnu-standards"), info_manuals, False),
        Source("postgresql-docs", ("postgresql-doc-15",), postgresql_docs, True),
        Source("gcide", ("dict-gcide",), dictd("gcide", clean_gcide), True),
        Source("jargon", ("dict-jargon",), dictd("jargon", clean_dictd), True),
        Source("foldoc", ("dict-foldoc",), dictd("foldoc", clean_dictd), True),
        Source("devils-dictionary", ("dict-devil",), dictd("devil", clean_dictd), True),
        Source("usr-share-doc", (), lambda: usr_share_doc(claimed), True),
    ]
