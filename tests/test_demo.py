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
    # a second invocation skips every finished step
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert again.returncode == 0 and again.stdout.count("already done") >= 8, again.stdout[-2000:]


def test_demo_help_lists_every_setting():
    res = subprocess.run([sys.executable, "-m", "halo_dist.cli", "demo", "--help"], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0
    for flag in ("--preset", "--stage2-steps", "--niah-lengths", "--csr-limit", "--out"):
        assert flag in res.stdout
