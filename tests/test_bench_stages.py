"""bench/bench_stages.py end to end on CPU (tiny configs), and the engine's MFU accounting it
reports."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from halo_dist.models.hypenet import HypeNetConfig
from halo_dist.models.flops import (attention_flop_terms, attention_flops_coefficient,
                                    flops_per_token)

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_stage2_benchmark_runs_the_launcher_without_checkpoints(shards, tmp_path):
    runs = tmp_path / "runs"
    cmd = [sys.executable, str(REPO / "bench" / "bench_stages.py"), "--data", str(shards),
           "--cpu-smoke", "--stages", "2", "--runs", str(runs)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    payload = json.loads(Path("/tmp/halo_dist_stages_cpu_smoke.json").read_text())
    s2 = payload["stage2"]
    assert s2["status"] == "ok" and s2["tokens_per_s"] > 0 and len(s2["losses"]) == 4
    run_dir = runs / "stage2cpu_smoke"
    assert (run_dir / "final" / "DONE").exists()
    # save_final=false
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())


def test_mfu_counts_attention_of_student_and_teacher_once_per_rank():
    student = HypeNetConfig(num_hidden_layers=4, mixer_types=["attention", "lightning"] * 2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            hidden_size=64)
    teacher = SimpleNamespace(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, hidden_size=64)
    terms = attention_flop_terms(student, teacher)
    # stage 1: no trained attention
    assert attention_flop_terms(None, teacher) == {**terms, "attn_layers": 0}
    assert attention_flop_terms(None, None) == {}
    assert terms == {"attn_layers": 2, "frozen_attn_layers": 4, "attn_dim": 64}
    # PaLM: 12 L d T for the 2 trained attention layers, 4 L d T for the 4 forward-only ones
    assert (flops_per_token(10, 5, **terms, context=512) == 6 * 10 + 2 * 5
            + (12 * 2 + 4 * 4) * 64 * 512)
    assert attention_flops_coefficient(**terms) == (12 * 2 + 4 * 4) * 64


@pytest.mark.slow
def test_multigpu_scaling_driver_runs_bench_stages_and_summarizes(shards, tmp_path):
    """bench/multigpu.py scaling (DP scaling, run at 1/4/8 GPUs on the device): the CPU
    run of its reference part goes through bench_stages end to end; the summary compares per-GPU
    throughput and the first steps' losses (DP = 2 against 1 gloo rank gives the same losses:
    tests/test_engine.py)."""
    out = tmp_path / "scaling.json"
    cmd = [sys.executable, str(REPO / "bench" / "multigpu.py"), "scaling", "--gpus", "1",
           "--cpu-smoke", "--data", str(shards), "--runs", str(tmp_path / "runs"), "--out",
           str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["runs"]["1"]["status"] == "ok" and len(payload["runs"]["1"]["losses"]) == 4
    from bench.multigpu import scaling_summary

    one = {"status": "ok", "tokens_per_s_per_gpu": 100.0,
           "losses": {"1": 2.0, "2": 1.5, "3": 1.2, "4": 1.0, "5": 0.1}}
    four = {"status": "ok", "tokens_per_s_per_gpu": 96.0,
            "losses": {"1": 2.0, "2": 1.5001, "3": 1.2, "4": 1.0, "5": 9.0}}
    got = scaling_summary({1: one, 4: four, 8: {"status": "failed rc=1"}}, reference=1)
    # step 5 is not compared
    assert got == {"dp_scaling_4gpu": 0.96, "loss_max_abs_diff_4gpu": pytest.approx(1e-4)}
    assert scaling_summary({1: {"status": "failed rc=1"}, 4: four}, reference=1) == {}


def test_summary_leaves_out_warm_up_and_the_profiler_window(tmp_path):
    """Stage 2's rows of a short GPU run (bench/gpu.sh train): steps 1-3 compile, 6-7 run under
    the profiler. Its steady MFU is that of steps 4-5; the plain median of steps 2-7 would report
    0.42."""
    from bench.bench_stages import profile_start, summarize_metrics

    rows = [(1, 0.019, 50.4), (2, 0.082, 11.7), (3, 0.261, 3.68), (4, 0.626, 1.533),
            (5, 0.629, 1.525), (6, 0.583, 1.646), (7, 0.067, 14.4)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "perf/tokens_per_s": 51200 * m, "perf/mfu": m,
                                        "perf/step_time_s": t}) + "\n" for s, m, t in rows))
    a = SimpleNamespace(extra=["loss.backend=compiled", "logging.profile_at_step=6",
                               "logging.profile_steps=2"])
    assert profile_start(a) == 6 and profile_start(SimpleNamespace(extra=[])) is None
    steady = summarize_metrics(path, steady=True, before_step=profile_start(a))
    assert steady["mfu"] == pytest.approx((0.626 + 0.629) / 2)
    # what a plain median reports
    assert summarize_metrics(path)["mfu"] == pytest.approx((0.261 + 0.583) / 2)


def test_a_random_teacher_gets_the_datas_vocabulary_when_it_embeds_fewer_ids(shards, tmp_path):
    """configs/tiny's teacher embeds 4,096 ids: on Qwen-tokenized shards (.bench_data, what the CPU
    rehearsals read) the benchmark sizes it to the Qwen vocabulary; on the tiny shards, or with the
    2B configs' Qwen-sized teacher, nothing is overridden."""
    from bench.bench_stages import vocab_fit
    from data_fixtures import run_prep

    qwen = tmp_path / "qwen"
    run_prep(qwen, max_docs=20, shard_tokens=4000)
    tiny, big = "configs/tiny/stage{stage}.yaml", "configs/bench/stage{stage}_2b.yaml"
    for stage in (1, 2, 3):
        assert vocab_fit(SimpleNamespace(data=qwen, config_pattern=tiny), stage) == [
            "model.random_teacher.vocab_size=151680"]  # 151,669 tokens, rounded up to 64
        assert vocab_fit(SimpleNamespace(data=shards, config_pattern=tiny), stage) == []
        assert vocab_fit(SimpleNamespace(data=qwen, config_pattern=big), stage) == []
