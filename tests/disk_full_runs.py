"""The launcher runs of ``tests/test_checkpoint_faults.py`` whose run folder fills up or turns
read-only. Runs inside a private mount namespace (``unshare -m``) where a small tmpfs is mounted at
TMPFS, so it can be filled and remounted read-only without touching the machine's file systems:

    python tests/disk_full_runs.py TMPFS SHARDS SCRATCH

Prints one JSON object: per scenario the exit code, the output and what the checkpoint folder holds
(folders, and what ``checkpoint_files.verify`` finds wrong with each).
"""

import json
import subprocess
import sys
from pathlib import Path

from stage_runs import run_launcher


def _record(res, checkpoints: Path) -> dict:
    from halo_dist.train.checkpoint_files import verify

    folders = sorted(p for p in checkpoints.iterdir() if p.is_dir()) if checkpoints.is_dir() else []
    return {"code": res.returncode, "stdout": res.stdout[-4000:], "stderr": res.stderr,
            "folders": [p.name for p in folders],
            "verify": {p.name: verify(p) for p in folders if p.name.startswith("step-")}}


def main() -> None:
    tmpfs, shards, scratch = map(Path, sys.argv[1:4])
    common = [f"data.train={shards}", "model.stage1_weights=null", "checkpoint.keep_last=2"]
    out = {}
    # no inode left after step 3: the step-4 checkpoint cannot create its folder
    run, every2 = tmpfs / "inodes", [*common, "schedule.total_steps=6", "checkpoint.every_steps=2"]
    res = run_launcher("stage2", run, *every2, faults=dict(fill_at=f"3:inodes:{tmpfs}"),
                       expect=None)
    out["inodes"] = _record(res, run / "checkpoints")
    for filler in tmpfs.glob("filler-*"):
        filler.unlink()
    # the same run started again on a read-only file system: refused before anything is loaded
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    out["readonly"] = _record(run_launcher("stage2", run, *every2, expect=None),
                              run / "checkpoints")
    subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
    # the disk of the run folder fills after step 2; the checkpoints are on another one
    run, checkpoints = tmpfs / "metrics", scratch / "checkpoints"
    res = run_launcher("stage2", run, *common, "schedule.total_steps=12",
                       "checkpoint.every_steps=0", f"checkpoint.dir={checkpoints}",
                       faults=dict(fill_at=f"2:bytes:{tmpfs}"), expect=None)
    out["metrics"] = _record(res, checkpoints)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
