"""bench/bench_teacher_placement.py on 2 gloo CPU ranks (tiny fp32 teacher), and the frozen-teacher
ZeRO-3 config the engine and the benchmark share."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from halo_dist.parallel.deepspeed_setup import frozen_teacher_zero3_config, zero_stage

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("micro,accum,dp,bf16", [(8, 1, 2, True), (2, 3, 4, False)])
def test_frozen_teacher_zero3_config_is_stage3_without_optimizer(micro, accum, dp, bf16):
    ds = frozen_teacher_zero3_config(micro, accum, micro * accum * dp, bf16=bf16)
    assert zero_stage(ds) == 3
    # every parameter sharded
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert "optimizer" not in ds and "scheduler" not in ds
    assert (ds["train_batch_size"]
            == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * dp)
    assert ds["bf16"] == {"enabled": bf16}


def test_zero3_teacher_engine_config():
    """The config ``Trainer._place_teacher`` gives DeepSpeed for a ZeRO-3-sharded frozen teacher:
    the student's batch layout (DeepSpeed checks it), no optimizer, every parameter partitioned
    (threshold 0)."""
    assert frozen_teacher_zero3_config(2, 3, 12, bf16=True) == {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 3,
        "train_batch_size": 12,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    assert frozen_teacher_zero3_config(1, 1, 1, bf16=False)["bf16"] == {"enabled": False}


def test_teacher_placement_benchmark_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "placement.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--log-dir", str(tmp_path / "torchrun_logs"),
           str(REPO / "bench" / "bench_teacher_placement.py"), "--cpu-smoke", "--out", str(out)]
    rendezvous = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in rendezvous and k != "OUT"}
    env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    payload = json.loads(out.read_text())
    assert (payload["world_size"] == 2 and payload["backend"] == "gloo"
            and payload["dtype"] == "float32")
    rep, z3 = payload["placements"]["replicated"], payload["placements"]["zero3"]
    assert rep["params_b"] == z3["params_b"] > 0
    # ZeRO-3 keeps about half of every parameter per rank (shards padded to a multiple of 2
    # elements)
    assert z3["param_bytes_per_gpu"] < rep["param_bytes_per_gpu"]
    assert 0.45 < payload["zero3_param_fraction"] < 0.55
    # same seed on every rank and in both placements: the same teacher, the same hidden states
    assert rep["weight_fingerprint_spread"] == z3["weight_fingerprint_spread"] == 0.0
    assert rep["weight_fingerprint"] == z3["weight_fingerprint"]
    assert payload["hidden_rms"] > 0 and payload["hidden_rel_err"] < 1e-5
    for r in (rep, z3):
        assert (r["ms_per_forward"] > 0
                and r["tokens_per_s_total"] == pytest.approx(2 * r["tokens_per_s_per_gpu"]))
    for key in ("replicated_tokens_per_s_per_gpu", "zero3_tokens_per_s_per_gpu",
                "replicated_peak_gib", "zero3_peak_gib"):
        assert key in payload
