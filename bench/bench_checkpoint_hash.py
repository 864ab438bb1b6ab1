"""What recording and verifying a checkpoint's files costs: seconds per GiB of XXH3-128
(``halo_dist.train.checkpoint_files.file_hash``, what a save and a resume use) against a plain
read and sha256, on one process.

Writes one file of random bytes into a temporary folder and reads it once before timing (warm page
cache: what a save pays to hash what it just wrote; a resume reading from disk adds the disk's
time); ``--cold`` drops the page cache before each mode (needs root).

  python bench/bench_checkpoint_hash.py              # 1 GiB
  python bench/bench_checkpoint_hash.py --gib 4 --cold
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_result  # noqa: E402
from halo_dist.train.checkpoint_files import CHUNK, file_hash  # noqa: E402


def read_only(path: Path) -> None:
    buf = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def sha256(path: Path) -> None:
    with open(path, "rb") as f:
        hashlib.file_digest(f, "sha256")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=int, default=1, help="file size")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each mode")
    a = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard.pt"
        with open(path, "wb") as f:
            for _ in range(a.gib * 16):
                f.write(os.urandom(64 << 20))
        read_only(path)
        for name, fn in (("read", read_only), ("xxh3_128", file_hash), ("sha256", sha256)):
            if a.cold:
                os.sync()
                Path("/proc/sys/vm/drop_caches").write_text("3\n")
            t0 = time.perf_counter()
            fn(path)
            rows.append({"mode": name, "s_per_gib": round((time.perf_counter() - t0) / a.gib, 3)})
    cache = "cold" if a.cold else "warm"
    print(f"checkpoint file hashing, one process, {a.gib} GiB, {cache} page cache")
    for r in rows:
        print(f"{r['mode']:>9} | {r['s_per_gib']:.3f} s per GiB")
    payload = {"rows": rows, "page_cache": cache, "gib": a.gib}
    write_result("checkpoint_hash", payload)
    return payload


if __name__ == "__main__":
    main()
