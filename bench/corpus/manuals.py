"""Man pages (rendered by man-db, or from their roff source), texinfo manuals and the READMEs, NEWS
and changelogs of /usr/share/doc as readable text."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.corpus.documents import decode_bytes, normalize, read_maybe_gz
from bench.corpus.html_docs import html_to_text


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
    return [strip_roff(decode_bytes(read_maybe_gz(p))) for p in files]


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
        text = "\n".join(decode_bytes(read_maybe_gz(p)) for _, p in sorted(parts[name]))
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
        data = read_maybe_gz(path)
        if b"\0" in data[:4096]:
            continue
        text = decode_bytes(data)
        out.append(html_to_text(text) if re.search(r"\.html?(\.gz)?$", path.name)
                   else normalize(text))
    return out
