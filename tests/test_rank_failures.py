"""An error on one rank ends every rank within seconds, with that rank's message printed (2 gloo
ranks on CPU).

The two ranks run as two independent processes with torchrun's environment, as ``srun`` starts
them without torchrun: no launcher ends the other rank when one exits, so only the run itself can.
Before, the failing rank waited in the ``finally: dist.barrier()`` of ``train/entry.py`` and the
other in a collective it never left (DeepSpeed's ``load_checkpoint``, a step's all-reduce): no
output, until the process group's timeout.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch
from distributed import free_port
from fault_injection import launcher_args
from stage_runs import rewrite_in_checkpoint

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY_STAGE2 = REPO / "configs" / "tiny" / "stage2.yaml"
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# every rank ends within this many seconds of the first one to end (the watchdog polls each second)
END_TOGETHER_S = 15.0


@dataclass
class Ended:
    """One rank's process after a launch."""

    code: int | None  # None: still running at the deadline (then killed)
    at: float  # seconds after the start
    output: str


def launch_ranks(tmp_path, run_dir, *overrides, world=2, faults=None, deadline=240.0):
    """``launchers/stage2.py`` as ``world`` independent rank processes; each rank's end."""
    script = [str(REPO / "launchers" / "stage2.py")]
    if faults:
        script = [str(REPO / "tests" / "fault_injection.py"), *launcher_args(**faults), *script]
    args = [*script, "--config", str(TINY_STAGE2), f"logging.run_dir={run_dir}",
            "logging.tensorboard=false", *overrides]
    base = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    base.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    logs = [open(tmp_path / f"rank{r}-{time.monotonic_ns()}.log", "w+") for r in range(world)]
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT,
                              cwd=REPO, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r, log in enumerate(logs)]
    ended: dict[int, float] = {}
    while len(ended) < world and time.monotonic() - start < deadline:
        for r, p in enumerate(procs):
            if r not in ended and p.poll() is not None:
                ended[r] = time.monotonic() - start
        time.sleep(0.1)
    outcomes = []
    for r, (p, log) in enumerate(zip(procs, logs)):
        code = p.poll()
        if code is None:
            p.kill()
            p.wait()
        log.seek(0)
        outcomes.append(Ended(code, ended.get(r, time.monotonic() - start), log.read()))
        log.close()
    return outcomes


def assert_all_ended_with(outcomes, code, message):
    """Every rank exited with ``code`` within END_TOGETHER_S of the first, and printed
    ``message``."""
    report = "\n".join(f"--- rank {r}: exit {o.code} at {o.at:.1f}s\n{o.output[-4000:]}"
                       for r, o in enumerate(outcomes))
    assert all(o.code is not None for o in outcomes), f"a rank hung:\n{report}"
    assert [o.code for o in outcomes] == [code] * len(outcomes), report
    first = min(o.at for o in outcomes)
    assert all(o.at - first < END_TOGETHER_S for o in outcomes), report
    assert all(message in o.output for o in outcomes), report


COMMON = ("model.stage1_weights=null", "schedule.total_steps=3", "schedule.warmup_steps=1",
          "checkpoint.every_steps=1")


@pytest.fixture(scope="module")
def failed_at_step(shards, tmp_path_factory):
    """A 2-rank run whose rank 1 alone raises after step 2 (step 1 is checkpointed)."""
    tmp = tmp_path_factory.mktemp("rank_failures")
    run_dir = tmp / "run"
    outcomes = launch_ranks(tmp, run_dir, f"data.train={shards}", *COMMON,
                            faults=dict(fail_at=(2, 1)))
    return tmp, run_dir, outcomes


@pytest.mark.slow
def test_a_failure_on_one_rank_at_a_step_ends_both_with_its_message(failed_at_step):
    _, run_dir, outcomes = failed_at_step
    # a bug (not a user error): exit 1 on both, rank 1 with its traceback, rank 0 with its line
    assert_all_ended_with(outcomes, 1, "injected failure on rank 1 after step 2")
    assert "Traceback" in outcomes[1].output and "InjectedFailure" in outcomes[1].output
    assert (f"error: rank 1 failed (on {socket.gethostname()}), so rank 0 stops too: "
            "InjectedFailure: injected failure on rank 1 after step 2" in outcomes[0].output
            ), outcomes[0].output[-3000:]
    assert (run_dir / "checkpoints" / "step-00000001" / "COMPLETE").exists()
    assert not (run_dir / "run.lock").exists()  # released by rank 0's watchdog on its way out


@pytest.mark.slow
def test_a_resume_under_another_zero_checkpoint_format_is_one_error(failed_at_step, shards):
    """Before: a bare AssertionError from DeepSpeed's load_checkpoint (ZeRO 3 -> 2)."""
    tmp, run_dir, _ = failed_at_step
    [ended] = launch_ranks(tmp, run_dir, f"data.train={shards}", *COMMON, "parallel.zero_stage=2",
                           world=1)
    errors = [line for line in ended.output.splitlines() if line.startswith("error:")]
    assert ended.code == 2 and "Traceback" not in ended.output, ended.output[-3000:]
    assert errors == [f"error: parallel.zero_stage: {run_dir / 'checkpoints' / 'step-00000001'} "
                      "was written with parallel.zero_stage=3, this run has 2: DeepSpeed reads a "
                      "ZeRO 3 (partitioned parameters) checkpoint only under that format. Resume "
                      "with parallel.zero_stage=3, or start a new run folder"], ended.output[-3000:]


@pytest.mark.slow
def test_a_refusal_on_one_rank_while_loading_ends_both_with_its_message(failed_at_step, shards):
    """Rank 1's own optimizer partition holds a pickled object: rank 1 refuses it inside
    DeepSpeed's load_checkpoint while rank 0 waits there for rank 1."""
    tmp, run_dir, _ = failed_at_step
    poisoned = (run_dir / "checkpoints" / "step-00000001"
                / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    # verification (every rank at once) catches damage, not a crafted file: only rank 1's load can
    # refuse it
    rewrite_in_checkpoint(poisoned, lambda p: torch.save(
        {"optimizer_state_dict": pathlib.PurePosixPath("/not/a/tensor")}, p))
    outcomes = launch_ranks(tmp, run_dir, f"data.train={shards}", *COMMON)
    assert_all_ended_with(outcomes, 2, f"refusing to load {poisoned}")
    assert (f"error: rank 1 failed (on {socket.gethostname()}), so rank 0 stops too: refusing "
            f"to load {poisoned}" in outcomes[0].output), outcomes[0].output[-3000:]
    assert all("Traceback" not in o.output for o in outcomes), outcomes[0].output[-3000:]


def _echo_of_another_failure():
    """Rank 1 fails with a user error; rank 0's collective then breaks (the echo) and it reports
    that: what each rank's report returns."""
    import torch.distributed as dist

    from halo_dist.errors import MissingInputError
    from halo_dist.parallel.rank_failures import FailureWatch

    watch = FailureWatch(dist.get_rank(), dist.get_world_size())  # no watchdog: reports only
    if dist.get_rank() == 1:
        error = MissingInputError("data.train: /shards/of/rank1 does not exist")
    else:
        while not watch.store.check([watch.key]):
            time.sleep(0.05)
        error = dist.DistBackendError("[gloo] Connection closed by peer [127.0.0.1]:4242")
    reported = watch.report(error)
    return type(reported).__name__, str(reported), getattr(reported, "exit_code", None)


def test_an_echo_of_another_ranks_failure_reports_that_failure():
    """A rank whose collective broke because another rank left says why: that rank's error, not
    a connection (or timeout) message."""
    from distributed import run_distributed

    rank0, rank1 = run_distributed(_echo_of_another_failure, world_size=2)
    assert rank1 == ("MissingInputError", "data.train: /shards/of/rank1 does not exist", None)
    assert rank0 == ("RankFailure", f"rank 1 failed (on {socket.gethostname()}), so rank 0 stops "
                                    "too: data.train: /shards/of/rank1 does not exist", 2)
