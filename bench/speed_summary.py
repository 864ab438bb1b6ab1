"""The headline speed figures as one file of top-level keys, each read from the result file that
measured it.

Reads (bench/results/): the 512K decode speed-up with both shapes timed in one process, in
alternating rounds (``decode_ratio.py``: the median per-round ratio, and HypeNet's distance to its
bytes bound), the
stage benchmark's logged run (``bench_stages.py``: stage 2 and 3 MFU over the steady steps, outside
warm-up and the profiler window, and stage 2's speed-up over the naive baseline of the same run),
the from-scratch runs (``bench_pretrain.py``: each variant's best mode), the OPD benchmark
(``bench_opd.py``) and the prefill result. A key whose source is missing is null.
Writes ``bench/results/speed_summary.json`` and prints the table.

  python bench/speed_summary.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import RESULTS, no_options, print_table  # noqa: E402

# each written by a suite of bench/gpu.sh (BENCHMARKS.md: the card, date and versions of each)
SOURCES = {
    # both shapes' shipped decoders at 512K in one process, alternating rounds (suite decode):
    # in two processes HypeNet ran right after its own 512K prefill and the GEMV shapes both
    # models share timed 4-12% slower than in the teacher's process
    "decode": RESULTS / "decode_ratio_512k.json",
    # stage 2 (2B) with its same-run naive baseline, and stage 3 at 16K (suite train)
    "stage2": RESULTS / "stages_train.json",
    "stage3": RESULTS / "stages_train_s3.json",
    # the whole OPD step at h2048: 256 rollouts (suite opd) and 512 (opd-512); the rollouts alone at
    # the shipped settings (suite opd: fp32 state written every 4 tokens); horizons 8K and 32K
    # (suites opd-8k, opd-32k)
    "opd": RESULTS / "opd_step.json",
    "opd_rollouts": RESULTS / "opd_rollouts.json",
    "opd_8k": RESULTS / "opd_h8k.json",
    "opd_512": RESULTS / "opd_step_512.json",
    "opd_32k": RESULTS / "opd_h32k.json",
    "inference": RESULTS / "inference.json",
    "pretrain": RESULTS / "pretrain.json",  # suite pretrain
}


def load(path: Path):
    if not path.exists():
        return None
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(path.read_text())


def summary() -> dict:
    src = {k: load(p) for k, p in SOURCES.items()}
    out: dict = {"sources": {k: str(p.relative_to(RESULTS))
                             for k, p in SOURCES.items() if p.exists()}}
    decode = src["decode"] or {}
    out["decode_speedup_512k"] = decode.get("decode_speedup")
    out["decode_bytes_bound_ratio_512k"] = decode.get("decode_bytes_bound_ratio")
    out["decode_steps_512k"] = {r["model"]: (r["step_ms"], r["bound_ms"])
                                for r in decode.get("rows", [])}
    for key in ("stage2_mfu", "stage2_speedup_vs_naive"):
        out[key] = (src["stage2"] or {}).get(key)
    out["stage3_mfu"] = (src["stage3"] or {}).get("stage3_mfu")
    opd = next((r for r in (src["opd"] or {}).get("results", []) if r.get("horizon") == 2048), None)
    rollouts = next((r for r in (src["opd_rollouts"] or {}).get("results", [])
                     if r.get("horizon") == 2048), None) or opd
    out["opd_rollout_tokens_per_s_h2048"] = rollouts and rollouts["rollout_tokens_per_s"]
    out["opd_step_tokens_per_s_h2048"] = opd and opd["opd_tokens_per_s"]
    opd512 = next((r for r in (src["opd_512"] or {}).get("results", [])
                   if r.get("horizon") == 2048 and "error" not in r), None)
    out["opd_rollout_tokens_per_s_h2048_512_rollouts"] = opd512 and opd512["rollout_tokens_per_s"]
    out["opd_step_tokens_per_s_h2048_512_rollouts"] = opd512 and opd512.get("opd_tokens_per_s")
    for horizon, key in ((8192, "opd_8k"), (32768, "opd_32k")):
        row = next((r for r in (src[key] or {}).get("results", [])
                    if r.get("horizon") == horizon and "error" not in r), None)
        out[f"opd_rollout_tokens_per_s_h{horizon}"] = row and row["rollout_tokens_per_s"]
        out[f"opd_step_tokens_per_s_h{horizon}"] = row and row.get("opd_tokens_per_s")
    out["prefill_speedup_512k"] = (src["inference"] or {}).get("prefill_speedup_512k")
    out["pretrain_mfu_transformer_500m"] = (src["pretrain"] or {}).get("transformer_mfu")
    out["pretrain_mfu_hypenet_500m"] = (src["pretrain"] or {}).get("hypenet_lightning_hype_mfu")
    return out


def main() -> dict:
    out = summary()
    print_table([{"key": k, "value": v}
                 for k, v in out.items() if k not in ("sources", "decode_steps_512k")],
                "speed figures (bench/results/speed_summary.json)")
    path = RESULTS / "speed_summary.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    no_options(__doc__)
    main()
