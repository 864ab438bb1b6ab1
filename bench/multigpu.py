"""Runs that need 4-8 GPUs, each through ``bench_stages.py`` and the real launchers, each
writing ``bench/results/multigpu_<part>.json`` with its headline keys at the top level.

* ``scaling``: stage 2 of HypeNet-2B (random Qwen3-1.7B-shape teacher,
  ``configs/bench/stage2_2b.yaml``, ZeRO-1) on 1, 4 and 8 GPUs with the same global batch (96 x
  512): tokens/s per GPU, scaling efficiency against 1 GPU (``dp_scaling_<n>gpu``, 0-1) and the
  per-step losses against 1 GPU's (``loss_max_abs_diff_<n>gpu``; bf16 runs agree to ~2e-4,
  BENCHMARKS.md's 2-GPU run).
* ``sp``: stage 3 at a long context under sequence parallelism (activation checkpointing, one row
  per step): tokens/s, MFU with attended keys, peak memory per GPU
  (``stage3_<ctx>_sp<n>_tokens_per_s``), and the losses of SP = 1, 2, ... at a reference length
  every size can run.
* ``9b``: stage 2 of HypeNet-9B from a random Qwen3-8B-shape teacher
  (``configs/bench/stage2_9b.yaml``) under ZeRO-3 on all GPUs, teacher replicated vs ZeRO-3-sharded:
  tokens/s per GPU, memory per GPU, micro-batch.

``--cpu-smoke`` runs the same code on CPU ranks (gloo, tiny configs): the test suite checks it that
way.

  python bench/multigpu.py scaling --gpus 1 4 8 --data .bench_data/long
  python bench/multigpu.py sp --gpus 4 --seq 1048576 --ref-seq 32768 --data .bench_data/long
  python bench/multigpu.py 9b --gpus 8 --micro 4 --data .bench_data/long
  python bench/multigpu.py scaling --gpus 1 2 --cpu-smoke --data SHARDS
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import RESULTS, print_table, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOSS_STEPS = 4  # steps whose losses are compared across GPU counts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=["scaling", "sp", "9b"])
    p.add_argument("--data", required=True,
                   help="token shards for every run (python bench/make_long_docs.py)")
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 4, 8],
                   help="scaling: GPU counts (the first is the reference); sp/9b: the GPU count")
    p.add_argument("--batch", type=int, default=96,
                   help="scaling: global batch (rows of 512 tokens)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seq", type=int, default=1_048_576, help="sp: the long context")
    p.add_argument("--ref-seq", type=int, default=32_768,
                   help="sp: the length every SP size runs, for losses")
    p.add_argument("--micro", type=int, default=4, help="9b: rows per GPU per micro-step")
    p.add_argument("--timeout", type=int, default=900, help="seconds per launcher run")
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench",
                   help="run folders of the launchers")
    p.add_argument("--cpu-smoke", action="store_true", help="CPU ranks (gloo), tiny configs")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.part in ("sp", "9b") and len(a.gpus) != 1:
        p.error(f"{a.part} runs on one GPU count, got --gpus {a.gpus}")
    if a.cpu_smoke:
        # bench_stages --cpu-smoke's stage-2 global batch and stage-3 length
        a.batch, a.seq = 4, 128
    if a.part == "scaling" and any(a.batch % n for n in a.gpus):
        p.error(f"--batch {a.batch} must divide by every GPU count {a.gpus}")
    return a


def stages(a, tag: str, *args: str) -> dict:
    """One ``bench_stages.py`` run; returns its result payload (failed runs keep their status)."""
    out = (Path(f"/tmp/halo_dist_multigpu_{tag}.json") if a.cpu_smoke
           else RESULTS / f"stages_mg_{tag}.json")
    cmd = [sys.executable, str(ROOT / "bench" / "bench_stages.py"), "--data", a.data, "--no-naive",
           "--tag", tag, "--out", str(out), "--timeout", str(a.timeout), "--runs", str(a.runs),
           *args] + (["--cpu-smoke"] if a.cpu_smoke else [])
    print("$ " + " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    if rc != 0 or not out.exists():
        return {"status": f"bench_stages rc={rc}"}
    return json.loads(out.read_text())


def length_name(tokens: int) -> str:
    """1048576 -> "1m", 32768 -> "32k", 128 -> "128"."""
    if tokens % 1_048_576 == 0:
        return f"{tokens // 1_048_576}m"
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def first_losses(run: dict) -> list[float]:
    losses = run.get("losses") or {}
    return [losses[k] for k in sorted(losses, key=int)[:LOSS_STEPS]]


def scaling(a) -> dict:
    runs = {}
    for n in a.gpus:
        micro = min(48, a.batch // n)  # 48 x 512 fits one H200 without activation checkpointing
        args = ["--stages", "2", "--steps", "1", str(a.steps), "1", "--nproc", str(n),
                "--stage2-batch", str(a.batch)]
        result = stages(a, f"dp{n}", *args,
                        *([] if a.cpu_smoke else ["--stage2-micro", str(micro)]))
        runs[n] = result.get("stage2", result)
    return {"reference_gpus": a.gpus[0], "global_batch": a.batch,
            **scaling_summary(runs, a.gpus[0]), "runs": {str(n): run for n, run in runs.items()}}


def scaling_summary(runs: dict[int, dict], reference: int) -> dict:
    """``dp_scaling_<n>gpu`` (tokens/s per GPU against the reference's) and
    ``loss_max_abs_diff_<n>gpu`` (over the first steps) for every run that finished, as is the
    reference."""
    ref, out = runs[reference], {}
    if ref.get("status") != "ok":
        return out
    for n, run in runs.items():
        if n == reference or run.get("status") != "ok":
            continue
        out[f"dp_scaling_{n}gpu"] = run["tokens_per_s_per_gpu"] / ref["tokens_per_s_per_gpu"]
        pairs = zip(first_losses(run), first_losses(ref))
        out[f"loss_max_abs_diff_{n}gpu"] = max((abs(x - y) for x, y in pairs), default=None)
    return out


def sequence_parallel(a) -> dict:
    n = a.gpus[0]
    sizes = [s for s in (1, 2, 4, 8) if s <= n]
    common = ["--stages", "3", "--stage3-micro", "1", "--stage3-batch", "1", "--checkpointing",
              "on"]
    ref = {}
    # the same rows at the reference length for every SP size (DP = 1: one row per step)
    for sp in sizes:
        run = stages(a, f"sp{sp}_ref", *common, "--steps", "1", "1",
                     str(min(a.steps, 3)), "--nproc", str(sp), "--sp", str(sp),
                     *([] if a.cpu_smoke else ["--stage3-seq", str(a.ref_seq)]))
        ref[sp] = run.get("stage3", run)
    long = stages(a, f"sp{n}_long", *common, "--steps", "1", "1", str(min(a.steps, 3)), "--nproc",
                  str(n), "--sp", str(n), *([] if a.cpu_smoke else ["--stage3-seq", str(a.seq)]))
    long = long.get("stage3", long)
    key = f"stage3_{length_name(a.seq)}_sp{n}_tokens_per_s"
    out = {key: long.get("tokens_per_s") if long.get("status") == "ok" else None,
           "long": {"seq": a.seq, "sp": n, **long},
           "reference": {str(s): r for s, r in ref.items()}}
    base = first_losses(ref[1]) if ref[1].get("status") == "ok" else []
    out["reference_loss_max_abs_diff"] = {
        str(s): max((abs(x - y) for x, y in zip(first_losses(r), base)), default=None)
        for s, r in ref.items() if s != 1 and r.get("status") == "ok" and base}
    return out


def nine_b(a) -> dict:
    n = a.gpus[0]
    out = {"gpus": n, "micro": a.micro}
    for placement in ("replicated", "zero3"):
        args = ["--stages", "2", "--steps", "1", str(a.steps), "1", "--nproc", str(n), "--zero",
                "3", "--stage2-micro", str(a.micro), "--stage2-batch", str(a.micro * n),
                "--extra", f"parallel.teacher_placement={placement}"]
        if not a.cpu_smoke:
            args += ["--config-pattern", "configs/bench/stage{stage}_9b.yaml"]
        out[placement] = stages(a, f"9b_{placement}", *args).get("stage2")
    return out


def _runs(payload: dict):
    """(name, bench_stages result) of every run in a payload, for the status lines."""
    for key, value in payload.items():
        if isinstance(value, dict) and "status" in value:
            yield key, value
        elif isinstance(value, dict):
            for sub, run in value.items():
                if isinstance(run, dict) and "status" in run:
                    yield f"{key}/{sub}", run


def main(argv=None) -> dict:
    a = parse_args(argv)
    a.data = str(Path(a.data).resolve())
    payload = {"scaling": scaling, "sp": sequence_parallel, "9b": nine_b}[a.part](a)
    payload["command"] = " ".join(sys.argv)
    heads = {k: v for k, v in payload.items() if not isinstance(v, dict)}
    for name, run in _runs(payload):
        heads[f"{name} status"] = run.get("status")
    print_table([{"key": k, "value": v} for k, v in heads.items()], f"multi-GPU {a.part}")
    out = a.out or (Path(f"/tmp/halo_dist_multigpu_{a.part}.json") if a.cpu_smoke else None)
    path = write_result(f"multigpu_{a.part}", payload, out)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
