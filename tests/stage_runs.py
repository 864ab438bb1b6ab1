"""Stage launcher runs for the engine tests: the tiny configs, ``run_launcher`` (a launcher
subprocess) and ``losses`` (a run's train/loss curve)."""

import os
import subprocess
import sys
from pathlib import Path

from fault_injection import launcher_args

from halo_dist.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny"


def run_launcher(stage, run_dir, *overrides, nproc=1, env=None, faults=None, expect=0, timeout=600,
                 config=None):
    """Run a stage launcher (torchrun for nproc > 1); returns the completed process. ``faults``:
    keyword arguments of ``fault_injection.launcher_args`` (``crash_at=3``, ``sigterm_at=2``,
    ``nan_at=(2, 3)``); the launcher then runs through tests/fault_injection.py, which installs
    those hooks in every rank."""
    script = [str(REPO / "launchers" / f"{stage}.py")]
    if faults:
        script = [str(REPO / "tests" / "fault_injection.py"), *launcher_args(**faults), *script]
    cmd = [sys.executable, *script]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--log-dir", str(Path(run_dir).parent / "torchrun_logs"), *script]
    cmd += ["--config", str(config or TINY / f"{stage}.yaml"), f"logging.run_dir={run_dir}",
            "logging.log_every=1", *overrides]
    # in-process distributed runs earlier in the session (e.g. OPD tests) leave this process's
    # rendezvous variables set; the launcher must pick its own port
    rendezvous = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    full_env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    full_env.update({"OMP_NUM_THREADS": "1", "HALO_CACHE": os.environ["HALO_CACHE"], **(env or {})})
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                         cwd=REPO)
    if expect is not None and res.returncode != expect:
        raise AssertionError(f"exit {res.returncode} (wanted {expect}):\n{res.stdout[-3000:]}\n"
                             f"{res.stderr[-5000:]}")
    return res


def losses(run_dir):
    return [v for _, v in read_metrics(run_dir)["train/loss"]]


def rewrite_in_checkpoint(path: Path, write) -> None:
    """``write(path)`` a checkpoint file anew, and its entry in the checkpoint's ``COMPLETE``
    manifest with it: a test that crafts a file must get past the size and checksum verification
    (which catches damage, not tampering) to reach the check it is about."""
    import json

    from halo_dist.train.checkpoint_files import MARKER, file_hash

    write(path)
    marker = path.parent / MARKER
    manifest = json.loads(marker.read_text())
    manifest["files"][path.name].update(size=path.stat().st_size, xxh3_128=file_hash(path))
    marker.write_text(json.dumps(manifest))
