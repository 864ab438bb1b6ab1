"""bench/find_syncs.py: it names the code that would make the host wait for the GPU, per step, and
the training loop reads its device flags once per step, not once per micro-batch."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path, *args):
    out = tmp_path / "syncs.json"
    res = subprocess.run([sys.executable, str(REPO / "bench" / "find_syncs.py"), "--out", str(out),
                          *args], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return json.loads(out.read_text()), res.stdout


def test_counts_each_sync_site_per_step_after_the_warm_up(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(
        "import torch\n"
        "from halo_dist.train.profiling import StepProfiler\n"
        "p = StepProfiler(0, 0, '.', 0, torch.device('cpu'))\n"
        "x = torch.arange(6.0)\n"
        "for step in range(1, 6):\n"
        "    p.before_step(step)\n"
        "    for _ in range(3):\n"
        "        float(x.sum())\n"
        "    if step == 1:\n"
        "        x.nonzero()\n"             # warm-up only: not counted
        "    x[x > 2].sum()\n")             # boolean indexing: a nonzero on the GPU
    report, stdout = _run(tmp_path, "--skip-steps", "1", "--", str(script))
    # steps 2-4: the warm-up step and the last (which holds what runs after training) left out
    assert report["steps_counted"] == 3 and report["syncs_per_step"] == 4.0
    sites = {(r["kind"], r["stack"][-1].split(" ")[0].rsplit(":", 1)[1]): r["per_step"]
             for r in report["sites"]}
    assert sites == {("aten::_local_scalar_dense", "8"): 3.0, ("aten::index", "11"): 1.0}
    assert "4.0 synchronising calls per step over 3 steps" in stdout


@pytest.mark.slow
def test_the_training_loop_agrees_on_a_nonfinite_loss_once_per_step(tmp_path):
    """Stage 2 on the tiny config with 2 micro-batches per step: the non-finite flag is read once
    per step (it was read after every forward, draining the queue before each backward)."""
    from data_fixtures import TINY_TOKENIZER, run_prep

    data = tmp_path / "data"
    run_prep(data, max_docs=60, shard_tokens=4000, tokenizer=TINY_TOKENIZER)
    report, _ = _run(tmp_path, "--skip-steps", "2", "--", "launchers/stage2.py", "--config",
                     "configs/tiny/stage2.yaml", "model.stage1_weights=null",
                     f"data.train={data}", "schedule.total_steps=5", "schedule.warmup_steps=1",
                     f"logging.run_dir={tmp_path / 'run'}", "checkpoint.every_steps=0",
                     "checkpoint.save_final=false", "logging.log_every=1",
                     "parallel.zero_stage=1")
    assert report["steps_counted"] == 2

    def per_step(function: str) -> float:
        return sum(r["per_step"] for r in report["sites"]
                   if any(frame.endswith(" " + function) for frame in r["stack"]))

    assert per_step("_nonfinite") == 1.0
    assert per_step("_global_tokens") == 1.0
    # the rest: DeepSpeed's two grad-norm checks and our grad-norm read; attended_context reads the
    # host-side cu_seqlens (no GPU sync) and shows here only because on CPU every tensor is local
    assert per_step("train_step") - per_step("attended_context") <= 5.0, report["sites"]
