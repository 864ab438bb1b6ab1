"""Dictionary-like sources: dictd dictionaries (GCIDE, FOLDOC, the Jargon File, the Devil's
Dictionary), WordNet's synsets and the King James Bible."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

from bench.corpus.documents import decode_bytes, tool_output


# =============================================================================== dictd dictionaries
_B64 = {c: i
        for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def _b64_number(text: str) -> int:
    n = 0
    for c in text:
        n = n * 64 + _B64[c]
    return n



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
    out = tool_output(["bible", "-l100000", "gen1:1-rev22:21"])
    return bible_books(out)
