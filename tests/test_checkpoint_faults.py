"""Damaged checkpoints and a run folder that fills up or turns read-only, through the real stage-2
launcher on CPU: every case ends with the run resumed from the newest checkpoint that verifies, or
with one ``error:`` line naming the path and the cause, the previous checkpoint intact.
"""

import json
import shutil
import subprocess
import sys

import pytest
from stage_runs import REPO, losses, run_launcher

from halo_dist.train.checkpoint_files import verify


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_skipped_and_the_run_resumes_from_the_one_before(shards,
                                                                                       tmp_path):
    """Step 4 lost its RNG file and has a shard cut short: the restarted run names both, resumes
    step 2 and trains the same curve; its save of step 4 replaces the damaged one."""
    common = [f"data.train={shards}", "model.stage1_weights=null", "schedule.total_steps=4",
              "checkpoint.every_steps=2"]
    run = tmp_path / "run"
    run_launcher("stage2", run, *common)
    straight, newest = losses(run), run / "checkpoints" / "step-00000004"
    (newest / "rng_rank00000.pt").unlink()
    shard = next(newest.glob("*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[:1000])
    out = run_launcher("stage2", run, *common).stdout
    assert f"skipping checkpoint {newest}: rank 0's rng_rank00000.pt is missing" in out, out[-3000:]
    assert f"rank 0's {shard.name} has 1000 bytes" in out
    assert f"resumed from {newest.parent / 'step-00000002'} at step 2" in out
    assert losses(run) == pytest.approx(straight, rel=1e-6, abs=1e-7)
    assert {p.name: verify(p) for p in sorted(newest.parent.glob("step-*"))} == {
        "step-00000002": [], "step-00000004": []}


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def disk_runs(shards, tmp_path_factory):
    """tests/disk_full_runs.py in a private mount namespace over a 400 MB tmpfs of 400 inodes."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"]).returncode:
        pytest.skip("needs a private mount namespace (unshare -m, as root)")
    root = tmp_path_factory.mktemp("disk")
    mnt = root / "tmpfs"
    mnt.mkdir()
    mount = 'mount -t tmpfs -o size=400m,nr_inodes=400 tmpfs "$0" && exec "$@"'
    res = subprocess.run(["unshare", "-m", "sh", "-c", mount, str(mnt), sys.executable,
                          str(REPO / "tests" / "disk_full_runs.py"), str(mnt), str(shards),
                          str(root / "scratch")], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-5000:]
    return json.loads(res.stdout.splitlines()[-1])


@pytest.mark.slow
def test_no_inodes_left_stops_with_one_error_and_the_previous_checkpoint(disk_runs):
    run = disk_runs["inodes"]
    errors = _error_lines(run["stderr"])
    assert run["code"] == 2 and len(errors) == 1, run["stderr"][-3000:]
    assert "Traceback" not in run["stderr"]
    assert ("incomplete-step-00000004: No space left on device" in errors[0]
            and "0 inodes free" in errors[0] and "no inodes left" in errors[0]
            and "step-00000002 is intact" in errors[0]), errors
    assert run["folders"] == ["step-00000002"] and run["verify"] == {"step-00000002": []}


def test_a_read_only_run_folder_is_refused_before_anything_is_loaded(disk_runs):
    run = disk_runs["readonly"]
    errors = _error_lines(run["stderr"])
    assert run["code"] == 2 and len(errors) == 1, run["stderr"][-3000:]
    # the run folder's lock is the first thing a run writes
    assert ("Read-only file system" in errors[0]
            and "refused before anything was loaded or written" in errors[0]), errors
    assert "Traceback" not in run["stderr"]
    assert "Load checkpoint" not in run["stdout"] + run["stderr"]  # DeepSpeed's load log line
    assert run["verify"] == {"step-00000002": []}


def test_a_full_run_folder_stops_the_run_with_a_checkpoint_and_one_error(disk_runs):
    """The metrics (TensorBoard events, metrics.jsonl) cannot be written after the disk filled: the
    run stops at that step's end with a checkpoint (on another disk) and one error line."""
    run = disk_runs["metrics"]
    errors = _error_lines(run["stderr"])
    assert run["code"] == 2 and len(errors) == 1, run["stderr"][-3000:]
    assert "Traceback" not in run["stderr"] and "Exception in thread" not in run["stderr"]
    (name,) = run["folders"]
    step = int(name.split("-")[1])
    assert 2 < step < 12 and run["verify"] == {name: []}, run
    assert ("No space left on device" in errors[0]
            and f"the run stopped at step {step} with its checkpoint in" in errors[0]), errors
