"""bench/build_corpus.py: text extractors, grouping, dedupe, the size budget, code gathering,
`build` end to end."""
from __future__ import annotations

import gzip
import json
import lzma
import random
import shutil
from pathlib import Path

import pytest
from data_fixtures import wiki_docs

from bench import build_corpus as B
from bench.corpus.code import code_roots
from bench.corpus.dictionaries import (bible_books, clean_dictd, clean_gcide, dictd_entries,
                                       wordnet_synsets)
from bench.corpus.documents import group_records, spread_keep
from bench.corpus.html_docs import html_to_text, reading_order
from bench.corpus.manuals import info_text, render_man, strip_roff
from bench.corpus.pack import collect, compress, fit_budget, Packed, REPORT, write_pack
from bench.corpus.sources import Source

# ----------------------------------------------------------------------------------- extractors
GCIDE_ENTRY = """Alcohol \\Al"co*hol\\ ([a^]l"k[-o]*h[o^]l), n. [Cf. F. alcool,
   formerly written alcohol, Sp. alcohol alcohol, antimony. Cf.
   {Alquifou}.]
   1. An impalpable powder. [Obs.]
      [1913 Webster]

   2. The fluid essence or pure spirit obtained by distillation.
      [Obs.] --Boyle.
      [1913 Webster]

   Note: As used in the U. S. "Pharmacop[oe]ia," alcohol
         contains 91 per cent by weight of ethyl alcohol and
         54.5 per cent of water.
         [1913 Webster +PJC]
"""

QUOTE_ENTRY = """Jamboree \\Jam`bo*ree"\\, n. [Etym. uncertain.]
   1. A noisy or unrestrained carousal or frolic; a spree.
      [Slang] --Kipling.

            A Calcutta-made pony cart had been standing in front
            of the manager's bungalow.                    --W. A.
                                                  Fraser.
      [Webster 1913 Suppl.]
"""


def test_gcide_entry_becomes_plain_dictionary_text():
    assert clean_gcide(GCIDE_ENTRY) == (
        "Alcohol, n. [Cf. F. alcool, formerly written alcohol, Sp. alcohol alcohol, antimony. Cf. "
        "Alquifou.]\n1. An impalpable powder. [Obs.]\n"
        "2. The fluid essence or pure spirit obtained by distillation. [Obs.] --Boyle.\n"
        'Note: As used in the U. S. "Pharmacopœia," alcohol contains 91 per cent by '
        'weight of ethyl alcohol '
        "and 54.5 per cent of water.")
    assert (clean_gcide(QUOTE_ENTRY).splitlines()
            == ["Jamboree, n. [Etym. uncertain.]",
                "1. A noisy or unrestrained carousal or frolic; a spree. [Slang] --Kipling.",
                "A Calcutta-made pony cart had been standing in front of the manager's bungalow. "
                "--W. A. Fraser."])
    assert (clean_gcide("Ab\\b\\ n. jamb[=u] caf['e] H[2]O [a^] r[^o]le [Obs.]")
            == "Ab n. jambū café H2O ă rôle [Obs.]")


def _dictd(tmp_path: Path, entries: dict[str, list[str]]) -> tuple[Path, Path]:
    """A dictd dictionary: .dict.dz (gzip, as dictzip files are) and an index of base64 offsets."""
    b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def enc(n):
        s = ""
        while True:
            s, n = b64[n % 64] + s, n // 64
            if n == 0:
                return s

    data, lines = b"", []
    for body, heads in entries.items():
        raw = body.encode()
        lines += [f"{h}\t{enc(len(data))}\t{enc(len(raw))}" for h in heads]
        data += raw
    (tmp_path / "d.dict.dz").write_bytes(gzip.compress(data))
    (tmp_path / "d.index").write_text("\n".join(sorted(lines)) + "\n")
    return tmp_path / "d.index", tmp_path / "d.dict.dz"


def test_dictd_entries_in_file_order_once_each_without_metadata(tmp_path):
    index, data = _dictd(tmp_path,
                         {"00-database-short\n   A test dictionary\n": ["00-database-short"],
                          "Law lords\n   Peers.\n": ["Law lords", "Law merchant"],
                          "Abbey\n   A monastery.\n": ["Abbey"]})
    assert dictd_entries(index, data) == ["Law lords\n   Peers.\n", "Abbey\n   A monastery.\n"]
    foldoc = ("light pen\n\n   <hardware> An early {pointing device} which\n"
              "   the user pointed.\n\n   (2003-12-02)\n")
    assert (clean_dictd(foldoc) == "light pen\n<hardware> An early pointing device which the "
                                     "user pointed.")


WORDNET_DATA = "".join(line + "  \n" for line in [  # real data lines end with two spaces
    "  1 This software and database is being provided to you, the LICENSEE, by",
    "  2 Princeton University under the following license.",
    "02083346 05 n 02 canine 0 canid 0 001 ~ 02084071 n 0000 | any of various fissiped mammals",
    "02084071 05 n 03 dog 0 domestic_dog 0 Canis_familiaris 0 002 @ 02083346 n 0000 ~ "
    "02085374 n 0000 | "
    'a member of the genus Canis; "the dog barked all night"'])


def test_wordnet_synsets_are_readable_lines_with_hypernyms(tmp_path):
    path = tmp_path / "data.noun"
    path.write_text(WORDNET_DATA)
    assert wordnet_synsets(path) == [
        "canine, canid (noun): any of various fissiped mammals.",
        'dog, domestic dog, Canis familiaris (noun): a member of the genus Canis; "the '
        'dog barked all night". '
        "Kind of: canine."]
    adj = tmp_path / "data.adj"
    adj.write_text("00001740 00 a 01 able 0 001 ! 00002098 a 0101 | having the means\n"
                   "00002098 00 a 01 unable(p) 0 001 ! 00001740 a 0101 | not able\n")
    assert wordnet_synsets(adj) == ["able (adjective): having the means. Opposite: unable.",
                                      "unable (adjective): not able. Opposite: able."]


ROFF = r""".\" a comment
.TH GREP 1 "2023-01-01" "GNU grep" "User Commands"
.SH NAME
grep \- print lines that match patterns
.SH SYNOPSIS
.B grep
[\fIOPTION\fR...] \fIPATTERNS\fR [\fIFILE\fR...]
.SH DESCRIPTION
.B grep
searches for
.I PATTERNS
in each
.IR FILE .
It prints each line that matches\(em a \(lqpattern\(rq.
.TP
.BR \-i ", " \-\^\-ignore\-case
Ignore case.
.nf
  keep  this
.fi
"""


def test_strip_roff_gives_plain_text():
    text = strip_roff(ROFF)
    assert text.split("\n\n") == [
        "GREP(1)", "NAME", "grep - print lines that match patterns", "SYNOPSIS",
        "grep [OPTION...] PATTERNS [FILE...]", "DESCRIPTION",
        "grep searches for PATTERNS in each FILE. It prints each line that matches— a “pattern”.",
        "-i, --ignore-case", "Ignore case.", "  keep  this"]


@pytest.mark.skipif(not shutil.which("man"), reason="man-db not installed")
def test_render_man_with_man_db(tmp_path):
    page = tmp_path / "grep.1"
    page.write_text(ROFF)
    text = render_man(page)
    assert "NAME\n       grep - print lines that match patterns" in text
    assert "\b" not in text and "\x1b" not in text and "“pattern”" in text


SPHINX_PAGE = (
    '<html><head><title>t</title><link rel="next" title="n" href="b.html" />'
    '<style>x{}</style></head>\n'
    '<body><div class="sphinxsidebar">Table of contents</div>\n'
    '<div class="body" role="main"><h1>4. Control Flow'
    '<a class="headerlink" href="#x">\u00b6</a></h1>\n'
    '<p>Use the <code>if</code>\n'
    '   statement &amp; friends.</p>\n'
    '<ul><li><p>first item</p></li><li>second</li></ul>\n'
    '<div class="highlight"><pre><span class="k">if</span> <span class="n">x</span>'
    '<span class="p">:</span>\n'
    '    <span class="k">pass</span>\n'
    '</pre></div>\n'
    '<table><tr><th>name</th><th>value</th></tr><tr><td><img src="i.png"/></td><td>one</td>'
    '<td>1</td></tr></table>\n'
    '</div><div class="footer">Copyright</div></body></html>')


def test_html_to_text_keeps_main_content_code_and_lists():
    assert html_to_text(SPHINX_PAGE) == (
        "4. Control Flow\n\nUse the if statement & friends.\n\n- first item\n- second\n\n"
        "if x:\n    pass\n\nname | value\none | 1")
    docbook = ('<html><body><div class="navheader">Prev Next</div><div class="toc">1. A</div>'
               '<div id="banner">Download</div><h2>1. Intro</h2><p>Text.</p></body></html>')
    assert html_to_text(docbook) == "1. Intro\n\nText."


def test_reading_order_follows_next_links():
    pages = {"index.html": '<link rel="next" href="ch1.html">',
             "ch1.html": '<a accesskey="n" href="sub/ch2.html">',
             "sub/ch2.html": '<link rel="next" href="../apx.html#top">', "apx.html": "",
             "lone.html": ""}
    assert reading_order(pages) == ["index.html", "ch1.html", "sub/ch2.html", "apx.html",
                                      "lone.html"]


def test_info_text_drops_headers_indexes_and_licences():
    info = ("This is x.info.\nINFO-DIR-SECTION Basics\n\x1f\nFile: x.info,  Node: Top,  Next: "
            "Intro\n\nX manual\n\x1f\nFile: x.info,  Node: Intro,  Up: Top\n\n1 Intro\n=======\n\n"
            "Some text.\n\x1f\nFile: x.info,  Node: GNU Free Documentation License\n\nLegal.\n"
            "\x1f\nFile: x.info,  Node: Concept Index\n\n* a: b.\n"
            "\x1f\nTag Table:\nNode: Top\x7f1\n\x1f\nEnd Tag Table\n")
    assert info_text(info) == "X manual\n\n1 Intro\n=======\n\nSome text."


def test_bible_books_from_the_bible_program_output():
    out = ("\nGenesis 1\n\n  1 In the beginning God created the heaven and the earth.\n  2 And the "
           "earth was\n\nGenesis 2\n\n  1 Thus the heavens\n\n1 John 1\n\n  1 That which was from "
           "the beginning\n")
    assert bible_books(out) == [
        "Genesis\n\nChapter 1\n\n1 In the beginning God created the heaven and the earth.\n"
        "2 And the earth was\n\nChapter 2\n\n1 Thus the heavens",
        "1 John\n\nChapter 1\n\n1 That which was from the beginning"]


# ------------------------------------------------------------------------- grouping, dedupe, budget
def test_group_records_makes_long_documents_in_order():
    recs = [f"r{i:03d}" + "x" * 96 for i in range(25)]  # 100 chars each
    docs = group_records(recs, target=500, max_chars=700)
    assert "\n\n".join(docs) == "\n\n".join(recs)  # nothing lost, order kept
    assert all(len(d) >= 500 for d in docs)
    big = group_records(["a" * 100, "b" * 2000, "c" * 100], target=500, max_chars=700)
    assert big == ["a" * 100, "b" * 2000, "c" * 100]  # a long record stays whole, never split
    tail = group_records(["a" * 300] * 4 + ["z" * 50], target=500, max_chars=700)
    # a short remainder joins the last document
    assert len(tail) == 2 and tail[-1].endswith("z" * 50)


def test_spread_keep_is_even():
    assert spread_keep(10, 5) == [1, 3, 5, 7, 9]
    assert spread_keep(4, 0) == [] and spread_keep(4, 9) == [0, 1, 2, 3]


def _src(name, records, group=False):
    return Source(name, (), lambda: list(records), group)


def test_collect_dedupes_across_sources_after_whitespace_normalisation(capsys):
    a = "Alpha beta gamma. " * 20
    packed = collect([_src("high", [a, "unique one " * 30]),
                        _src("low", [a.replace(" ", "\n  "), "unique two " * 30, "unique two " * 30,
                                     "tiny"])])
    high, low = packed
    assert (high.duplicates, low.duplicates) == (0, 2)
    # "tiny" is under MIN_DOC_CHARS
    assert len(high.docs) == 2 and low.docs == [("unique two " * 30).strip()]


def _noise(n: int, seed: int) -> str:
    """Text that xz cannot shrink much, so compressed sizes track characters."""
    r = random.Random(seed)
    return "".join(r.choices("abcdefghijklmnopqrstuvwxyz0123456789 ", k=n))


def test_budget_drops_lowest_priority_first_and_thins_evenly(tmp_path):
    packed = [Packed(name, [_noise(4000, i * 100 + j) for j in range(10)]) for i, name in
              enumerate(["first", "second", "third"])]
    one = len(compress("first", packed[0].docs))
    fit_budget(packed, int(one * 1.5))
    first, second, third = packed
    assert first.dropped_docs == 0 and len(first.docs) == 10
    assert 0 < len(second.docs) < 10 and second.dropped_docs == 10 - len(second.docs)
    assert third.docs == [] and third.dropped_docs == 10
    assert sum(len(p.blob) for p in packed) <= one * 1.5
    report = write_pack(packed, tmp_path)
    assert [f.name for f in sorted(tmp_path.glob("*.jsonl.xz"))] == ["00-first.jsonl.xz",
                                                                     "01-second.jsonl.xz"]
    rows = {r["source"]: r for r in report["sources"]}
    assert rows["third"]["budget_dropped_documents"] == 10 and rows["third"]["file"] is None
    recs = [json.loads(ln) for ln in lzma.open(tmp_path / "01-second.jsonl.xz", "rt")]
    assert [r["text"] for r in recs] == second.docs and {r["source"] for r in recs} == {"second"}


def test_pack_command_writes_within_budget(tmp_path, monkeypatch, capsys):
    srcs = [_src("wiki", [_noise(3000, i) for i in range(30)]), _src("man", [_noise(3000, 99)])]
    monkeypatch.setattr(B, "natural_sources", lambda workers: srcs)
    assert B.main(["pack", "--out", str(tmp_path / "t"), "--max-mb", "0.1", "--no-apt"]) == 0
    total = sum(f.stat().st_size for f in (tmp_path / "t").iterdir())
    report = json.loads((tmp_path / "t" / REPORT).read_text())
    assert total <= 100_000 and report["sources"][1]["budget_dropped_documents"] == 1
    assert "wiki" in capsys.readouterr().out


# ----------------------------------------------------------------------------------- code
def _site_packages(root: Path) -> Path:
    """A fake site-packages: two packages (one vendoring the other's file), a loose module, and
    junk."""
    (root / "alpha" / "sub").mkdir(parents=True)
    (root / "alpha" / "__pycache__").mkdir()
    (root / "beta" / "_vendor").mkdir(parents=True)
    (root / "alpha-1.0.dist-info").mkdir()
    (root / "alpha" / "__init__.py").write_text("from .core import run\n")
    (root / "alpha" / "core.py").write_text("def run(x):\n    return x + 1\n")
    (root / "alpha" / "sub" / "util.py").write_text("def helper():\n    '''Help.'''\n"
                                                    "    return 2\n")
    (root / "alpha" / "__pycache__" / "core.cpython-311.py").write_text("cached = 1\n")
    (root / "alpha" / "empty.py").write_text("\n")
    (root / "alpha" / "minified.py").write_text("x=" + "1+" * 800 + "1\n")
    table = "".join(f"    'key{i}': 'value',\n" for i in range(200))
    (root / "alpha" / "table.py").write_text("T = {\n" + table + "}\n")
    (root / "alpha" / "latin1.py").write_bytes(b"s = '\xe9'\n")
    (root / "alpha" / "huge.py").write_text("# big\n" + "y = 1\n" * 60_000)
    (root / "beta" / "main.py").write_text("import alpha\n\n\nclass Beta:\n    pass\n")
    # same as alpha/core.py
    (root / "beta" / "_vendor" / "core.py").write_text("def run(x):\n    return x + 1\n")
    (root / "six.py").write_text("PY3 = True\n")
    (root / "alpha-1.0.dist-info" / "thing.py").write_text("meta = 1\n")
    return root


def test_gather_code_makes_repository_documents_per_package(tmp_path):
    code = B.gather_code([(_site_packages(tmp_path / "sp"), None)])
    assert sorted(code.docs) == ["code:alpha", "code:beta", "code:single-modules"]
    assert code.docs["code:alpha"] == ["# file: alpha/__init__.py\nfrom .core import run\n\n"
                                       "# file: alpha/core.py\ndef run(x):\n    return x + 1\n\n"
                                       "# file: alpha/sub/util.py\ndef helper():\n    '''Help.'''\n"
                                       "    return 2\n"]
    assert code.docs["code:beta"] == ["# file: beta/main.py\nimport alpha\n\n\nclass Beta:\n"
                                      "    pass\n"]
    assert code.docs["code:single-modules"] == ["# file: six.py\nPY3 = True\n"]
    assert code.skipped == {"empty": 1, "too_big": 1, "long_lines": 1, "literal_data": 1,
                            "not_utf8": 1, "duplicate": 1}
    assert code.files == {"code:alpha": 3, "code:beta": 1, "code:single-modules": 1}


def test_code_documents_split_at_the_size_limit(tmp_path, monkeypatch):
    pkg = tmp_path / "sp" / "gamma"
    pkg.mkdir(parents=True)
    for i in range(6):
        (pkg / f"m{i}.py").write_text(f"def f{i}():\n" + "    return 0\n" * 40)
    monkeypatch.setattr(B, "CODE_DOC_CHARS", 1200)
    docs = B.gather_code([(tmp_path / "sp", None)]).docs["code:gamma"]
    assert len(docs) > 1 and all(len(d) <= 1200 for d in docs)
    assert [ln for d in docs for ln in d.splitlines() if ln.startswith("# file:")] == [
        f"# file: gamma/m{i}.py" for i in range(6)]


def test_code_roots_of_this_interpreter():
    roots = code_roots()
    assert roots[0][1] == "code:stdlib" and (roots[0][0] / "os.py").is_file()
    assert any(tag is None and "site-packages" in str(p) for p, tag in roots)


# --------------------------------------------------------------------------------- build end to end
def _pack(tmp_path: Path, n_wiki: int) -> Path:
    docs = group_records(list(wiki_docs(400)), target=6000, max_chars=8000)[:n_wiki]
    packed = [Packed("wiki", docs),
              Packed("bible", ["In the beginning God created the heaven. " * 10])]
    for p in packed:
        p.blob = compress(p.name, p.docs)
    write_pack(packed, tmp_path / "text")
    return tmp_path / "text"


def _build(tmp_path, text, code_root, *extra):
    argv = ["build", "--text", str(text), "--tokenizer", "offline-qwen3", "--out",
            str(tmp_path / "corpus"), "--code-root", str(code_root), "--num-proc", "1",
            "--long-min-chars", "3000", *extra]
    return B.main(argv)


def test_build_end_to_end_reports_the_mix_and_is_idempotent(tmp_path, capsys):
    text, code = _pack(tmp_path, 12), _site_packages(tmp_path / "sp")
    assert _build(tmp_path, text, code, "--heldout-fraction", "0.25") == 0
    out = tmp_path / "corpus"
    report = json.loads((out / "corpus_report.json").read_text())
    manifest = json.loads((out / "all" / "manifest.json").read_text())
    assert manifest["complete"] and report["heldout_natural_docs"] > 0
    rows = {r["source"]: r for r in report["sets"]["all"]["sources"]}
    # the fixed order
    assert list(rows) == ["wiki", "bible", "code:alpha", "code:beta", "code:single-modules"]
    assert (rows["wiki"]["train_docs"] + rows["wiki"]["heldout_docs"] == 12
            and rows["wiki"]["heldout_docs"] > 0)
    for split in ("train", "heldout"):  # the report is read from data_prep's own per-input counts
        by_file = manifest["splits"][split]["sources"]
        assert (sum(r[f"{split}_tokens"] for r in rows.values())
                == manifest["splits"][split]["tokens"])
        assert by_file[rows["wiki"]["file"]]["tokens"] == rows["wiki"][f"{split}_tokens"]
    long_rows = {r["source"]: r for r in report["sets"]["long"]["sources"]}
    # code and the bible are < 3000 chars
    assert [s for s, r in long_rows.items() if r["documents"]] == ["wiki"]
    long_docs = [json.loads(ln)["text"] for f in sorted((out / "inputs" / "long").glob("*.jsonl"))
                 for ln in open(f)]
    # short ones are empty placeholders
    assert len(long_docs) == 16 and sum(1 for d in long_docs if d) == 12
    assert all(len(d) >= 3000 for d in long_docs if d)
    long_manifest = json.loads((out / "long" / "manifest.json").read_text())
    assert long_manifest["totals"]["empty_docs_skipped"] == 4
    # every wiki document is long: the same ones are held out of both sets
    for split in ("train", "heldout"):
        assert long_rows["wiki"][f"{split}_tokens"] == rows["wiki"][f"{split}_tokens"] > 0
    assert "code:alpha" in capsys.readouterr().out

    stamp = {p: p.stat().st_mtime_ns
             for p in out.rglob("*") if p.is_file() and p.name != "corpus_report.json"}
    assert _build(tmp_path, text, code, "--heldout-fraction", "0.25") == 0
    assert {p: p.stat().st_mtime_ns for p in stamp} == stamp  # nothing was rewritten
    again = json.loads((out / "corpus_report.json").read_text())
    assert again["sets"] == report["sets"]


def test_build_fails_when_no_natural_text_is_held_out(tmp_path):
    from data_prep.tokenize import is_heldout

    text = _pack(tmp_path, 2)  # documents 0-2 are natural text, 40 one-file packages follow
    for i in range(40):
        (tmp_path / "sp" / f"pkg{i:02d}").mkdir(parents=True)
        (tmp_path / "sp" / f"pkg{i:02d}" / "m.py").write_text(f"VALUE = {i}\n")
    assert not any(is_heldout(i, 0.1, 0) for i in range(3)) and any(is_heldout(i, 0.1, 0)
                                                                    for i in range(3, 43))
    with pytest.raises(SystemExit, match="held-out split holds no natural-language document"):
        _build(tmp_path, text, tmp_path / "sp", "--heldout-fraction", "0.1")


def test_build_with_retrieval_docs_adds_a_set_and_leaves_the_others_alone(tmp_path):
    """--retrieval-docs: `long_retrieval` is `long` plus synthetic retrieval documents after all
    of it; `all` and `long` are byte for byte those of a build without them; the filler is natural
    training text, never a Wikipedia extract (the NIAH haystack) nor a held-out document."""
    text, code = _pack(tmp_path, 12), _site_packages(tmp_path / "sp")
    assert _build(tmp_path, text, code, "--heldout-fraction", "0.25") == 0
    plain = {p: json.loads((tmp_path / "corpus" / p / "manifest.json").read_text())["splits"]
             for p in ("all", "long")}
    shutil.rmtree(tmp_path / "corpus")
    assert _build(tmp_path, text, code, "--heldout-fraction", "0.25", "--retrieval-docs", "3",
                  "--retrieval-chars", "4000") == 0
    out = tmp_path / "corpus"
    for name in ("all", "long"):
        assert json.loads((out / name / "manifest.json").read_text())["splits"] == plain[name]
    inputs = sorted((out / "inputs" / "long_retrieval").glob("*.jsonl"))
    long_inputs = sorted((out / "inputs" / "long").glob("*.jsonl"))
    assert [p.name for p in inputs[:-1]] == [p.name for p in long_inputs]
    synthetic = [json.loads(line)["text"] for line in open(inputs[-1])]
    assert len(synthetic) == 3 and inputs[-1].name.endswith("retrieval.jsonl")
    wiki = [json.loads(line)["text"] for p in long_inputs if "wiki" in p.name for line in open(p)]
    paragraphs = {q for d in wiki if d for q in d.split("\n\n")}
    assert not any(q in paragraphs for d in synthetic for q in d.split("\n\n"))
    assert any("In the beginning" in d for d in synthetic)  # the bible is the only filler left
    report = json.loads((out / "corpus_report.json").read_text())
    assert report["sets"]["long_retrieval"]["totals"]["tokens"] > report["sets"]["long"]["totals"][
        "tokens"]
    with pytest.raises(SystemExit, match="gathered with --retrieval-docs 3, not 0"):
        _build(tmp_path, text, code, "--heldout-fraction", "0.25")
    # an index gathered with the natural text weighed 3 times is not reused as the plain corpus
    index_file = out / "inputs" / "index.json"
    index_file.write_text(json.dumps({**json.loads(index_file.read_text()), "natural_repeats": 3}))
    with pytest.raises(SystemExit, match="gathered with natural text repeats 3, not 1"):
        _build(tmp_path, text, code, "--heldout-fraction", "0.25", "--retrieval-docs", "3",
               "--retrieval-chars", "4000")
