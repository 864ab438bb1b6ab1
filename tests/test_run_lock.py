"""A run folder has one writer: a second run on it is refused with one ``error:`` line naming the
holder, a stale lock (same host, dead process; an earlier run of a requeued Slurm job) is taken over
with a message, and a lock from another host is refused with the advice to remove it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import run_distributed

from halo_dist.config import load_config
from halo_dist.train.run_lock import (LOCK_NAME, Holder, RunDirBusyError, RunDirLock,
                                      _proc_start, claim_run_dirs)

REPO = Path(__file__).resolve().parents[1]
TINY_STAGE2 = REPO / "configs" / "tiny" / "stage2.yaml"
TINY_OPD = REPO / "configs" / "opd" / "tiny.yaml"
HOLD = ("import sys, time\n"
        "from halo_dist.train.run_lock import RunDirLock\n"
        "RunDirLock.acquire(sys.argv[1])\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n")


@pytest.fixture
def holder(tmp_path):
    """Another process holding ``tmp_path/run``'s lock; yields (folder, process)."""
    folder = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE,
                            text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "held"
    yield folder, proc
    proc.kill()
    proc.wait()


def forge(folder: Path, **fields) -> Path:
    """A lock file as a run with ``fields`` would have left it."""
    folder.mkdir(parents=True, exist_ok=True)
    record = {**vars(Holder.this_process()), **fields}
    (folder / LOCK_NAME).write_text(json.dumps(record))
    return folder / LOCK_NAME


def test_a_live_holder_is_named_and_a_dead_one_is_taken_over(holder, capsys):
    folder, proc = holder
    recorded = json.loads((folder / LOCK_NAME).read_text())
    assert recorded["pid"] == proc.pid and recorded["host"] == socket.gethostname()
    with pytest.raises(RunDirBusyError) as excinfo:
        RunDirLock.acquire(folder)
    assert (f"{folder} is in use by another run (pid {proc.pid} on {socket.gethostname()}, "
            f"started {recorded['started']}" in str(excinfo.value)
            and "another logging.run_dir" in str(excinfo.value)), str(excinfo.value)
    os.kill(proc.pid, signal.SIGKILL)  # a kill -9: the file stays, its process is gone
    proc.wait()
    assert (folder / LOCK_NAME).exists()
    lock = RunDirLock.acquire(folder)
    assert (f"lock: taking over {folder / LOCK_NAME} from pid {proc.pid} on "
            f"{socket.gethostname()}" in capsys.readouterr().out)
    assert json.loads((folder / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (folder / LOCK_NAME).exists()
    RunDirLock.acquire(folder).release()  # a released folder is free at once, without a message
    assert "taking over" not in capsys.readouterr().out


def test_pid_reuse_and_hosts_and_slurm_requeues(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "run"
    # this host, a live pid that belongs to another process than the one that took the lock
    forge(folder, pid=os.getppid(), proc_start="1")
    RunDirLock.acquire(folder).release()
    assert "now belongs to another process" in capsys.readouterr().out
    # this host, the live process that took it (nobody flocks the forged file: as on a
    # filesystem without locks, the contents alone decide)
    forge(folder, pid=os.getppid(), proc_start=_proc_start(os.getppid()))
    with pytest.raises(RunDirBusyError, match=f"pid {os.getppid()}"):
        RunDirLock.acquire(folder)
    # another host: cannot be checked from here
    path = forge(folder, host="node-elsewhere", pid=4242, slurm_job="77", slurm_restart=0)
    with pytest.raises(RunDirBusyError) as excinfo:
        RunDirLock.acquire(folder)
    message = str(excinfo.value)
    assert ("pid 4242 on node-elsewhere" in message and "Slurm job 77" in message
            and "cannot be checked from here" in message
            and f"remove {path} and start again" in message), message
    # ... unless it was an earlier run of this Slurm job, which Slurm requeued
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    RunDirLock.acquire(folder).release()
    assert "it was run 0 of Slurm job 77, now requeued" in capsys.readouterr().out
    # the same run of that job elsewhere (srun -n 2 without torchrun: two one-rank runs) is not
    forge(folder, host="node-elsewhere", pid=4242, slurm_job="77", slurm_restart=1)
    with pytest.raises(RunDirBusyError, match="node-elsewhere"):
        RunDirLock.acquire(folder)


def _claim_both(held, free):
    """Both ranks claim the folders of a run in ``held`` (locked by another process), then of one
    in ``free``: per folder, (locks this rank holds, the refusal it got)."""
    import torch.distributed as dist

    out = []
    for run_dir in (held, free):
        cfg = load_config(TINY_STAGE2, [f"logging.run_dir={run_dir}"])
        try:
            locks = claim_run_dirs(cfg, dist.get_rank())
        except RunDirBusyError as e:
            out.append((0, str(e)))
            continue
        out.append((len(locks.locks), None))
        locks.release()
    return out


def test_every_rank_gets_rank_0s_verdict(holder, tmp_path):
    folder, proc = holder
    ranks = run_distributed(_claim_both, world_size=2, args=(str(folder), str(tmp_path / "free")))
    (held0, refusal0), (free0, _) = ranks[0]
    (held1, refusal1), (free1, _) = ranks[1]
    assert held0 == held1 == 0 and refusal0 == refusal1 and f"pid {proc.pid}" in refusal1
    assert (free0, free1) == (1, 0)  # rank 0 holds the free run's lock, rank 1 none


@pytest.mark.slow
def test_a_second_run_on_a_run_dir_in_use_is_refused_before_writing(tmp_path):
    """Two runs of ``launchers/opd.py`` on one run dir. Before: both trained, the later one
    overwriting config.yaml and metrics.jsonl (and final/ when it ended)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, str(REPO / "launchers" / "opd.py"), "--config", str(TINY_OPD),
           f"logging.run_dir={tmp_path / 'run'}", "logging.tensorboard=false",
           "logging.log_every=1", "schedule.total_steps=100000", "schedule.decay_steps=4",
           "opd.eval_every=0", "opd.snapshot_every=0", "checkpoint.every_steps=0"]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"})
    try:
        while not (line := first.stdout.readline()).startswith("step 1/"):  # it trains
            assert line, "the first run ended before its first step"
        config = (tmp_path / "run" / "config.yaml").read_text()
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO,
                                env={**env, "OMP_NUM_THREADS": "1"})
        first.send_signal(signal.SIGTERM)  # the first run checkpoints and ends
        assert first.wait(timeout=120) == 0
    finally:
        first.kill()
        first.wait()
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert (len(errors) == 1 and f"{tmp_path / 'run'} is in use by another run (pid {first.pid} "
            f"on {socket.gethostname()}" in errors[0]), second.stderr[-3000:]
    assert (tmp_path / "run" / "config.yaml").read_text() == config  # the second wrote nothing
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # released when the first ended
