"""slurm/ on a real Slurm: one node (scripts/local_slurm.sh: slurmctld, slurmd, munge), real sbatch.

tests/slurm_real.py runs the scenario once per session, in the background from the start (see
there): the HALO chain, a chain with a failing step, a stage job preempted twice, and the sweep as a
job array.
These tests read what it recorded. Without root and without a reachable Slurm they are skipped.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import slurm_real
from slurm_real import LOCAL_SLURM, STEPS, Job, Scenario

# one real Slurm scenario (a chain, a failure, a requeue, a sweep) shared by every test: minutes
pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def slurm_scenario(tmp_path_factory) -> Scenario:
    return slurm_real.result(tmp_path_factory)


def _by_run(log: str) -> list[str]:
    """A requeued job's log (--open-mode=append) cut into its runs."""
    return re.split(r"^(?=# step \S+: job \d+ \(restart \d+\))", log, flags=re.M)[1:]


def _assert_completed(sc: Scenario, name: str, step: str) -> Job:
    job = sc.job(name, step)
    assert job.state == "COMPLETED" and job.fields.get("ExitCode") == "0:0", \
        f"{name} {step}: {job.states}\n{sc.log(name, step)[-3000:]}"
    return job


# ------------------------------------------------------------------------------------------------
# The tests
# ------------------------------------------------------------------------------------------------


def test_chain_runs_every_step_in_order_and_the_export_loads(slurm_scenario):
    sc = slurm_scenario
    # -rP shows it
    print(f"real-Slurm scenario: {sc.seconds:.0f} s\n" + (sc.root / "timeline.txt").read_text())
    res = sc.drivers["chain"]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert list(sc.ids["chain"]) == STEPS
    assert "chain finished: every step done" in res.stdout
    jobs = [_assert_completed(sc, "chain", step) for step in STEPS]
    for (prev, job), step in zip(zip(jobs, jobs[1:]), STEPS[1:]):
        assert f"--dependency=afterok:{prev.id} " in res.stdout
        assert job.fields["StartTime"] >= prev.fields["EndTime"], (step, prev.fields, job.fields)
    # --gpus-per-node reached Slurm
    assert "gpu:1" in sc.job("chain", "stage2").fields.get("TresPerNode", "")
    runs = sc.runs("chain")
    layers = json.loads((runs / "select" / "selection.json").read_text())["attn_layers"]
    assert len(layers) == 1
    assert f"model.attn_layers={layers[0]}" in sc.log("chain", "stage2")
    niah = json.loads((runs / "eval" / "niah" / "niah.json").read_text())
    assert (niah["summary"]
            and json.loads((runs / "eval" / "csr.json").read_text())["csr_tasks"] == ["arc_easy"])

    import torch
    from transformers import AutoModelForCausalLM

    from halo_dist.models.trust import load_tokenizer

    export = runs / "export" / "hypenet-tiny"
    model = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True)
    assert model.config.attn_layers == layers
    calibrated = json.loads((runs / "stage3" / "final"
                             / "config.json").read_text())["attn_logits_scale_base"]
    # the export step carried calibrate's a
    assert model.config.attn_logits_scale_base == calibrated
    tok = load_tokenizer(export)
    ids = torch.tensor([tok("The capital of France is").input_ids])
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, ids.shape[1] + 3)


def test_a_failing_step_stops_the_chain_and_the_driver_names_it(slurm_scenario):
    sc = slurm_scenario
    res, ids = sc.drivers["fail"], sc.ids["fail"]
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert list(ids) == STEPS
    prep = _assert_completed(sc, "fail", "prep")
    stage1 = sc.job("fail", "stage1")
    # torchrun exits 1 when its rank exits 2 (the launcher's code for a user mistake)
    assert stage1.state == "FAILED" and stage1.fields["ExitCode"] == "1:0", stage1.states
    assert stage1.fields["StartTime"] >= prep.fields["EndTime"]
    assert (f"error: step stage1 (job {ids['stage1']}) ended FAILED (exit code "
            "1:0" in res.stderr), res.stderr
    assert "no-such-shards" in res.stderr  # the stage's own error line, quoted from its log
    assert "not run: select stage2 stage3 calibrate export eval" in res.stderr
    for step in STEPS[2:]:
        job = sc.job("fail", step)
        assert (job.state == "CANCELLED"
                and job.fields["Reason"] == "DependencyNeverSatisfied"), (step, job.states)
        assert all(state != "RUNNING" for _, state, _, _ in job.states), (step, job.states)
        assert not (sc.runs("fail") / "logs" / f"{step}-{ids[step]}.log").exists()
        assert not (sc.runs("fail") / step).exists()


def test_usr1_and_scontrol_requeue_stop_the_stage_and_the_requeued_job_ends_with_the_same_weights(
    slurm_scenario):
    from safetensors.torch import load_file

    sc = slurm_scenario
    assert list(sc.ids.get("preempt", {})) == ["stage1"], sc.drivers.get("preempt")
    done = [text for _, text in sc.events]
    assert any(t.startswith("scancel --signal=USR1 --batch") for t in done) and any(
        t.startswith("scontrol requeue") for t in done), done
    job = _assert_completed(sc, "preempt", "stage1")
    assert job.fields["Restarts"] == "2", job.states
    first, second, third = _by_run(sc.log("preempt", "stage1"))
    # run 1: the batch shell got USR1 (--batch: it alone), srun and torchrun passed it on, the
    # trainer saved and stopped
    assert "received SIGUSR1: forwarding SIGUSR1" in first, first[-3000:]
    stopped = re.search(r"stopped by signal \S+ at step (\d+); checkpoint saved", first)
    assert stopped and 3 <= int(stopped.group(1)) < 100, first[-3000:]
    assert f"requeueing job {job.id} (restart 1)" in first
    # run 2: resumed from that step; `scontrol requeue` sent TERM to every process of the job
    # (SIGKILL only KillWait seconds later): the batch shell passed USR1 on, the trainer saved and
    # stopped again
    assert re.search(rf"resumed from .*step[- ]0*{stopped.group(1)}\b", second), second[-3000:]
    assert "received SIGTERM: forwarding SIGUSR1" in second, second[-3000:]
    again = re.search(r"stopped by signal \S+ at step (\d+); checkpoint saved", second)
    assert again and int(again.group(1)) > int(stopped.group(1)), second[-3000:]
    assert re.search(rf"resumed from .*step[- ]0*{again.group(1)}\b", third), third[-3000:]
    assert "stage1 finished" in third
    straight = load_file(sc.runs("chain") / "stage1" / "final" / "rnn_layers.safetensors")
    resumed = load_file(sc.runs("preempt") / "stage1" / "final" / "rnn_layers.safetensors")
    assert straight.keys() == resumed.keys()
    for key in straight:
        # bit-identical to the uninterrupted chain's stage 1
        assert (straight[key] == resumed[key]).all(), key


def test_sweep_array_runs_both_variants_one_at_a_time_then_the_comparison(slurm_scenario):
    sc = slurm_scenario
    res, ids = sc.drivers["sweep"], sc.ids["sweep"]
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert list(ids) == ["sweep_task", "sweep_eval"] and "--array=0-1%1" in res.stdout
    assert "is complete" in res.stdout  # the chain's shards: no data prep job
    tasks = [sc.jobs[f"{ids['sweep_task']}_{i}"] for i in (0, 1)]
    for task in tasks:
        assert task.state == "COMPLETED" and task.fields["ExitCode"] == "0:0", task.states
    first, second = sorted(tasks, key=lambda t: t.fields["StartTime"])
    assert second.fields["StartTime"] >= first.fields["EndTime"] and sc.concurrent_tasks == 1
    # Slurm itself held the second task back for the array's limit, not for lack of CPUs or GPUs
    assert any("JobArrayTaskLimit" in reasons
               for reasons in sc.pending_reasons.values()), sc.pending_reasons
    evaljob = sc.job("sweep", "sweep_eval")
    assert evaljob.state == "COMPLETED" and evaljob.fields["StartTime"] >= second.fields["EndTime"]
    runs = sc.runs("sweep")
    for name in ("transformer", "hypenet"):
        assert (runs / name / "final" / "DONE").exists()
        assert (runs / name / "niah" / "niah.json").exists()
    table = (runs / "sweep_niah.md").read_text()
    assert "| transformer |" in table and "| hypenet |" in table and "missing" not in table, table


def test_torchrun_jobs_on_one_node_each_use_their_own_rendezvous_port(slurm_scenario):
    sc = slurm_scenario
    logs = ([sc.log("chain", s) for s in ("stage1", "stage2", "stage3")]
            + [sc.log("fail", "stage1"), sc.log("preempt", "stage1")])
    array = sc.ids["sweep"]["sweep_task"]
    logs += [p.read_text() for p in (sc.runs("sweep") / "logs").glob(f"sweep-{array}_*.log")]
    ports = [set(re.findall(r"--rdzv_endpoint \S+:(\d+)", log)) for log in logs]
    assert all(len(p) == 1 for p in ports), ports  # a requeued job keeps its port
    assert len(set.union(*ports)) == len(logs) == 7, ports


def _pids(folder: Path) -> list[int]:
    return [int(p.read_text()) for p in folder.glob("run/*.pid")]


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # an exited daemon init has not reaped yet is gone


def test_local_slurm_up_and_down_are_idempotent(slurm_scenario):
    env = slurm_scenario.env
    conf = Path(env["SLURM_CONF"])
    if conf != Path(slurm_real.local_conf()) or os.geteuid() != 0:
        pytest.skip(f"Slurm at {conf} is not scripts/local_slurm.sh's: not stopped by a test")

    def run(cmd):
        return subprocess.run(["bash", str(LOCAL_SLURM), cmd], capture_output=True, text=True,
                              timeout=300)

    t0 = time.time()
    res = run("up")
    assert (res.returncode == 0 and "already up" in res.stdout
            and time.time() - t0 < 10), res.stdout + res.stderr
    folder = conf.parent.parent
    pids = _pids(folder)
    assert len(pids) >= 2
    res = run("down")
    assert res.returncode == 0, res.stderr
    assert not folder.exists() and not any(_alive(p) for p in pids)
    assert slurm_real.not_ready(env) is not None
    res = run("down")
    assert res.returncode == 0 and "nothing" in res.stdout
    res = run("up")  # back for the rest of the session (and .ci/run's down)
    assert res.returncode == 0 and slurm_real.not_ready(env) is None, res.stdout + res.stderr


def test_local_slurm_bad_input():
    res = subprocess.run(["bash", str(LOCAL_SLURM), "start"], capture_output=True, text=True)
    assert res.returncode == 2 and "unknown command 'start' (up, down, status, env)" in res.stderr
    res = subprocess.run(["bash", str(LOCAL_SLURM), "up"], capture_output=True, text=True,
                         env={**os.environ, "HALO_LOCAL_SLURM_GPUS": "two"})
    assert res.returncode == 2 and "HALO_LOCAL_SLURM_GPUS=two must be a count" in res.stderr
