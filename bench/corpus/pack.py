"""The ``pack`` command's parts: the Debian packages installed, every source read, cleaned,
deduplicated and grouped, fitted into the size budget (lowest priority dropped first) and written
as xz JSONL with its report."""

from __future__ import annotations

import json
import lzma
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bench.corpus.documents import MIN_DOC_CHARS, dedupe, group_records, normalize, spread_keep
from bench.corpus.sources import Source

REPORT = "pack_report.json"


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
