"""What ``data.verify`` costs at start-up: seconds per GB of shards for ``sizes`` and ``full``.

Writes shards of random uint32 token documents (the layout ``data_prep`` writes: one ``.npy`` member
per document of ~2K tokens) into a temporary folder, then times the two modes over all of them on
one process, as one rank checks its share:

  sizes  stat each shard against the manifest's byte count
  full   also walk the tar structure, count samples and tokens, and sha256 the bytes

The files are read once before timing (warm page cache: the figure is the CPU cost of the check,
what a node pays when its local disk or network file system delivers faster than that); ``--cold``
drops the page cache first (needs root) to include the disk.

  python bench/bench_verify.py                  # 512 MB
  python bench/bench_verify.py --mb 2048 --cold
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_result  # noqa: E402
from halo_dist.data.manifest import ShardInfo  # noqa: E402
from halo_dist.data.shards import ShardWriter  # noqa: E402
from halo_dist.data.stream import check_shard  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=512, help="shard bytes to write and check")
    p.add_argument("--shard-mb", type=int, default=64, help="bytes per shard")
    p.add_argument("--doc-tokens", type=int, default=2048, help="tokens per document (sample)")
    p.add_argument("--cold", action="store_true",
                   help="drop the page cache before each mode (root)")
    p.add_argument("--dir", type=Path, default=None,
                   help="where the shards go (default: a temp folder)")
    return p.parse_args(argv)


def write_shards(folder: Path, total_mb: int, shard_mb: int, doc_tokens: int) -> list[ShardInfo]:
    rng = np.random.default_rng(0)
    infos, per_shard = [], shard_mb * 2**20 // (4 * doc_tokens)  # documents per shard
    for i in range(max(1, total_mb // shard_mb)):
        path = folder / f"shard-{i:06d}.tar"
        with ShardWriter(path) as w:
            for d in range(per_shard):
                w.add(i * per_shard + d, 0, 1,
                      rng.integers(0, 151_000, doc_tokens, dtype=np.uint32))
        r = w.record
        infos.append(ShardInfo(str(path), r["samples"], r["tokens"], r["bytes"], r["sha256"]))
    return infos


def drop_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def time_mode(infos: list[ShardInfo], mode: str, cold: bool) -> float:
    if cold:
        drop_cache()
    else:
        for s in infos:  # warm: the file system's cost is left out
            Path(s.path).read_bytes()
    t0 = time.perf_counter()
    for s in infos:
        check_shard(s, "full" if mode == "full" else "size")
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    a = parse_args(argv)
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        infos = write_shards(Path(tmp), a.mb, a.shard_mb, a.doc_tokens)
        gb = sum(s.bytes for s in infos) / 1e9
        rows = []
        for mode in ("sizes", "full"):
            s = time_mode(infos, mode, a.cold)
            rows.append({"mode": mode, "gb": round(gb, 3), "seconds": round(s, 4),
                         "s_per_gb": round(s / gb, 4)})
    cache = "cold" if a.cold else "warm"
    print(f"data.verify cost, one process, {len(infos)} shards of {a.shard_mb} MB, {cache} page "
          "cache")
    print(f"{'mode':>6} | {'GB':>6} | {'seconds':>8} | {'s per GB':>8}")
    for r in rows:
        print(f"{r['mode']:>6} | {r['gb']:>6.3f} | {r['seconds']:>8.3f} | {r['s_per_gb']:>8.3f}")
    payload = {"rows": rows, "page_cache": cache, "shards": len(infos), "shard_mb": a.shard_mb}
    write_result("verify_cost", payload)
    return payload


if __name__ == "__main__":
    main()
