"""HTML manuals as readable text, their pages in reading order (Python's documentation, the Debian
reference and handbook, PostgreSQL's documentation)."""

from __future__ import annotations

import html.parser
import os
import re
from pathlib import Path
from typing import Callable

from bench.corpus.documents import decode_bytes, normalize, read_maybe_gz, require_dir

_BLOCK_TAGS = {"p", "div", "section", "article", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt",
               "dd", "tr", "table", "ul", "ol", "dl", "blockquote", "pre", "br", "hr", "figure",
               "caption", "header", "footer", "main", "title"}
# a blank line around
_SPACED_TAGS = {"h1", "h2", "h3", "h4", "h5", "h6", "p", "pre", "table", "blockquote"}
_SKIP_TAGS = {"script", "style", "head", "nav", "noscript", "svg", "button", "form", "select",
              "textarea"}
_SKIP_IDS = {"banner", "title"}  # publican's (debian-handbook) page chrome
_SKIP_CLASSES = {"sphinxsidebar", "related", "footer", "navheader", "navfooter", "toc", "docnav",
                 "headerlink", "mobile-nav", "breadcrumbs", "copyright", "indexterm", "sidebar-toc",
                 "navigation"}
_VOID = {"br", "hr", "img", "meta", "link", "input", "area", "base", "col", "embed", "source",
         "wbr", "param"}


class HtmlText(html.parser.HTMLParser):
    """HTML -> readable text: block elements become lines, ``<pre>`` keeps its layout, chrome is
    skipped.

    With ``main_only`` only the element marked ``role="main"`` is read (Sphinx pages put sidebars
    and navigation around it).
    """

    def __init__(self, main_only: bool = False):
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, bool, bool]] = []  # (tag, skipped, main) of open elements
        self.out: list[str] = []
        self.inline: list[str] = []
        # raw text of the open <pre> (highlighters split it into many spans)
        self.pre_text: list[str] = []
        self.pre = 0
        self.main_only = main_only

    def _reading(self) -> bool:
        if any(skip for _, skip, _ in self.stack):
            return False
        return not self.main_only or any(main for _, _, main in self.stack)

    def _in(self, tag: str) -> bool:
        return any(t == tag for t, _, _ in self.stack)

    def _flush(self) -> None:
        text = " ".join("".join(self.inline).split())
        if text == "-":  # a list bullet waiting for the paragraph inside its <li>
            return
        if text:
            self.out.append(text)
        self.inline = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = set((a.get("class") or "").split())
        skip = (tag in _SKIP_TAGS or bool(classes & _SKIP_CLASSES) or a.get("id") in _SKIP_IDS
                or a.get("role") == "navigation")
        if tag in _BLOCK_TAGS and self.pre == 0:
            self._flush()
            if tag in _SPACED_TAGS and self._reading() and not self._in("li"):
                self.out.append("")
        if tag == "li" and self._reading():
            self.inline.append("- ")
        if tag in ("td", "th") and self._reading() and "".join(self.inline).strip():
            self.inline.append(" | ")  # between the cells of a row that already has text
        if tag == "pre":
            self.pre += 1
        if tag not in _VOID:
            self.stack.append((tag, skip, a.get("role") == "main"))

    def handle_endtag(self, tag):
        if tag in _VOID or not any(t == tag for t, _, _ in self.stack):
            return
        while self.stack:
            t, _, _ = self.stack.pop()
            if t == "pre":
                self.pre -= 1
                if self.pre == 0:
                    self.out.append("".join(self.pre_text).strip("\n"))
                    self.pre_text = []
            if t == tag:
                break
        if tag in _BLOCK_TAGS and self.pre == 0:
            self._flush()
            if tag in _SPACED_TAGS and not self._in("li"):
                self.out.append("")

    def handle_data(self, data):
        if not self._reading():
            return
        if self.pre:
            self.pre_text.append(data)
        else:
            self.inline.append(data)

    def text(self) -> str:
        self._flush()
        return normalize("\n".join(self.out))


def html_to_text(markup: str) -> str:
    """Readable text of an HTML page (only its ``role="main"`` part when it has one)."""
    parser = HtmlText(main_only='role="main"' in markup)
    parser.feed(markup)
    parser.close()
    return normalize(parser.text().replace("\u00b6", ""))


_NEXT_LINK = re.compile(r'<(?:link|a)\b[^>]*?(?:rel="next"|accesskey="n")[^>]*>', re.I)


def next_page(markup: str) -> str | None:
    """The ``next`` page an HTML page links to (``<link rel="next">`` or DocBook's
    ``accesskey="n"``)."""
    m = _NEXT_LINK.search(markup)
    if not m:
        return None
    href = re.search(r'href="([^"#]+)', m.group(0))
    return href.group(1) if href else None


def reading_order(pages: dict[str, str]) -> list[str]:
    """Page names in book order: follow each chain of ``next`` links from the pages nothing points
    at."""
    nxt = {}
    for name, markup in pages.items():
        target = next_page(markup)
        if target:
            target = os.path.normpath(os.path.join(os.path.dirname(name), target))
            if target in pages and target != name:
                nxt[name] = target
    pointed = set(nxt.values())
    order, seen = [], set()
    for head in sorted(p for p in pages if p not in pointed) + sorted(pages):
        page = head
        while page is not None and page not in seen:
            seen.add(page)
            order.append(page)
            page = nxt.get(page)
    return order


def html_manual(root: Path, pattern: str = "**/*.html*",
                skip: Callable[[str], bool] = lambda n: False) -> list[str]:
    """Text of every page of an HTML manual under ``root``, in reading order."""
    pages = {}
    for path in sorted(root.glob(pattern)):
        name = path.relative_to(root).as_posix()
        if path.is_file() and re.search(r"\.html?(\.gz)?$", name) and not skip(name):
            pages[name.removesuffix(".gz")] = decode_bytes(read_maybe_gz(path))
    return [html_to_text(pages[n]) for n in reading_order(pages)]


def _python_docs_skip(name: str) -> bool:
    """Indexes, search and licence pages of the Sphinx build are not prose."""
    base = os.path.basename(name)
    return (name.startswith(("_sources/", "_static/"))
            or base.startswith(("genindex", "py-modindex", "search"))
            or base in ("license.html", "copyright.html", "bugs.html", "about.html",
                        "contents.html", "download.html"))


def python_docs() -> list[str]:
    root = Path("/usr/share/doc/python3.11/html")
    return html_manual(require_dir(root), skip=_python_docs_skip)


def debian_reference() -> list[str]:
    return html_manual(require_dir(Path("/usr/share/debian-reference")), "*.en.html")


def debian_handbook() -> list[str]:
    root = Path("/usr/share/doc/debian-handbook/html/en-US")
    return html_manual(require_dir(root), "*.html", skip=lambda n: n.startswith("Common_Content"))


def postgresql_docs() -> list[str]:
    roots = sorted(Path("/usr/share/doc").glob("postgresql-doc-*/html"))
    if not roots:
        raise FileNotFoundError("/usr/share/doc/postgresql-doc-*/html not found (apt-get install "
                                "postgresql-doc-15)")
    return html_manual(roots[-1], "*.html",
                       skip=lambda n: n.startswith(("bookindex", "legalnotice")))
