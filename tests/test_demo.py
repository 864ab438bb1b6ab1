"""`halo-dist demo` at its smallest setting, end to end (issue 10, item 4).

Every step runs for real (SmolLM2 teacher, Wikipedia shards, stages 1-3, selection, calibration,
NIAH, lm-eval CSR, report); only the sizes are tiny.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_tiny_runs_every_step_and_writes_the_report(tmp_path, smollm2_dir):
    out = tmp_path / "demo"
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-m", "halo_dist.cli", "demo", "--preset", "tiny", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = (out / "report.md").read_text()
    for section in ("## Training", "## Needle in a haystack", "## Commonsense"):
        assert section in report
    pictures = sorted(p.name for p in (out / "report").glob("*.png"))
    assert {"stage1_loss.png", "stage2_loss.png", "stage3_loss.png", "csr.png"} <= set(pictures), pictures
    assert any(name.startswith("niah_student") for name in pictures) and any(name.startswith("niah_teacher") for name in pictures)
    assert (out / "hypenet" / "modeling_hypenet.py").exists() and (out / "hypenet" / "tokenizer_config.json").exists()
    assert list((out / "stage2" / "tb").glob("events.*"))  # TensorBoard logs
    # finished stages drop their resumable checkpoints (GBs of optimizer state each)
    assert not any((out / stage / "checkpoints").exists() for stage in ("stage1", "stage2", "stage3"))
    # a second invocation skips every finished step
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert again.returncode == 0 and again.stdout.count("already done") >= 8, again.stdout[-2000:]


def _stage_dir(root: Path, stage: str, done: bool) -> Path:
    (root / stage / "checkpoints" / "step-00000003").mkdir(parents=True)
    (root / stage / "final").mkdir()
    if done:
        (root / stage / "final" / "DONE").write_text("ok")
    return root / stage / "checkpoints"


@pytest.mark.parametrize("keep", [False, True])
def test_demo_prunes_only_finished_stages_checkpoints(tmp_path, keep):
    from halo_dist.demo import Demo, DemoSettings

    finished, running = _stage_dir(tmp_path, "stage1", done=True), _stage_dir(tmp_path, "stage2", done=False)
    demo = Demo(DemoSettings(out=str(tmp_path), keep_checkpoints=keep))
    demo.prune_checkpoints("stage1")
    demo.prune_checkpoints("stage2")
    demo.prune_checkpoints("stage3")  # never ran: nothing to do
    assert finished.exists() == keep
    assert running.exists()  # an unfinished stage keeps what it needs to resume


def test_demo_boolean_flags_parse_both_ways():
    import argparse

    from halo_dist.demo import add_demo_command

    parser = argparse.ArgumentParser()
    add_demo_command(parser.add_subparsers())
    assert parser.parse_args(["demo", "--keep-checkpoints"]).keep_checkpoints is True
    assert parser.parse_args(["demo", "--no-keep-checkpoints"]).keep_checkpoints is False
    assert parser.parse_args(["demo"]).keep_checkpoints is None  # the preset decides


def test_demo_help_lists_every_setting():
    res = subprocess.run([sys.executable, "-m", "halo_dist.cli", "demo", "--help"], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0
    for flag in ("--preset", "--stage2-steps", "--niah-lengths", "--csr-limit", "--out"):
        assert flag in res.stdout
