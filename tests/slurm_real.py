"""The real-Slurm scenario behind tests/test_slurm_real.py, run once per session in a background
thread.

tests/conftest.py starts it as soon as collection shows a test that needs it, so its jobs (in
scripts/local_slurm.sh's idle-class CPU cgroup) use the CPU time the rest of the suite leaves
unused; the tests then read what it recorded. It submits, all at once, on the node's CPUs:

* chain: the whole HALO chain of slurm/halo_tiny.sh (data prep -> ... -> NIAH + CSR), HALO_WAIT=1;
* fail: the same chain with a stage-1 mistake (held-out shards that do not exist), HALO_WAIT=1;

and, once the chain's data prep completed, on its shards:

* preempt: a stage-1 job alone (the driver, every other step marked done) that gets `scancel
  --signal=USR1 --batch` and later `scontrol requeue` while it trains;
* sweep: slurm/sweep_scratch.sh with two tiny variants, a job array limited to one task at a time.

The teacher is a random 4-layer Qwen3 saved as a folder with the offline Qwen tokenizer; the data
are the offline Wikipedia extracts. Everything lives in one folder of pytest's temporary tree,
removed when the session passed.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "slurm"
LOCAL_SLURM = REPO / "scripts" / "local_slurm.sh"
STEPS = ["prep", "stage1", "select", "stage2", "stage3", "calibrate", "export", "eval"]
# stage 1 long enough (~40 ms a step on one core) that a signal sent after its third step lands
# mid-training; the same arguments for the chain (the uninterrupted run) and the preempted job
STAGE1_ARGS = "schedule.total_steps=100 logging.log_every=1 checkpoint.every_steps=0"
# stages 2 and 3: the chain's plumbing, not training
ONE_STEP = "schedule.warmup_steps=0 schedule.total_steps=1"
POLL_S = 0.5
# from the session's start: the jobs may wait while the other tests keep both CPUs busy
DEADLINE_S = 1500
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD",
          "REQUEUE_FED", "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT"}


# ------------------------------------------------------------------------------------------------
# A reachable Slurm
# ------------------------------------------------------------------------------------------------


def local_conf() -> str:
    out = subprocess.run(["bash", str(LOCAL_SLURM), "env"], capture_output=True, text=True,
                         check=True).stdout
    return out.strip().split("=", 1)[1]


def not_ready(env: dict) -> str | None:
    """None when sinfo answers with a node that takes jobs, else what went wrong."""
    if shutil.which("sinfo", path=env.get("PATH")) is None:
        return "sinfo not found"
    if env.get("SLURM_CONF") and not Path(env["SLURM_CONF"]).is_file():
        return f"{env['SLURM_CONF']} does not exist"
    try:
        res = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env,
                             timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 20 s"
    if res.returncode != 0:
        return (res.stderr.strip().splitlines() or ["sinfo failed"])[-1]
    states = res.stdout.split()
    if not any(s.rstrip("*~#") in ("idle", "mixed", "allocated", "completing") for s in states):
        return f"no node takes jobs (sinfo: {' '.join(states) or 'no nodes'})"
    return None


def base_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HALO_", "SLURM_", "SBATCH_"))}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}:/usr/sbin:/sbin"
    env["SLURM_CONF"] = os.environ.get("SLURM_CONF") or local_conf()
    return env


# ------------------------------------------------------------------------------------------------
# Watching jobs
# ------------------------------------------------------------------------------------------------


@dataclass
class Job:
    """What `scontrol show job -o` said about one job (or array task), polled every POLL_S."""

    id: str
    fields: dict = field(default_factory=dict)
    states: list = field(default_factory=list)  # (time, JobState, Restarts, Reason) at each change
    gone: bool = False  # no longer listed (a pending array's record once its tasks have their own)

    @property
    def state(self) -> str:
        return self.fields.get("JobState", "")

    @property
    def active(self) -> bool:
        return not self.gone and self.state in ACTIVE


def scontrol_jobs(env: dict) -> dict[str, dict]:
    """Every job slurmctld still holds, by id (array tasks as ARRAYID_TASK)."""
    res = subprocess.run(["scontrol", "show", "job", "-o"], capture_output=True, text=True, env=env,
                         timeout=30)
    jobs = {}
    for line in res.stdout.splitlines():
        f = dict(re.findall(r"(\w+)=(\S*)", line))
        if "JobId" not in f:
            continue
        key = f["JobId"]
        if f.get("ArrayTaskId") not in (None, "", "N/A"):
            key = f"{f['ArrayJobId']}_{f['ArrayTaskId']}"
        jobs[key] = f
    return jobs


def submitted_ids(stdout: str) -> dict[str, str]:
    """{step: job id} from a driver's '# submitted STEP: job ID' lines."""
    return dict(re.findall(r"^# submitted (\S+): job (\d+)$", stdout, re.M))


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return -1
    steps = [json.loads(line)["step"]
             for line in path.read_text().splitlines() if line.strip().startswith("{")]
    return max(steps, default=-1)


def write_tiny_teacher(folder: str) -> None:
    """A random Qwen3 of configs/tiny/model.yaml's shape as an HF folder, with the offline Qwen
    tokenizer and its vocabulary, not configs/tiny's small one: slurm/halo_tiny.sh's layer selection
    and NIAH lengths (96, 160 tokens) are sized for Qwen's tokens, and the small BPE needs more
    of them for the same text (run in a subprocess: seeding torch here would change the other
    tests' random numbers)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from halo_dist.assets.tokenizer import load_qwen_tokenizer
    from halo_dist.config import load_tree

    shape = dict(load_tree(REPO / "configs" / "tiny" / "model.yaml")["model"]["random_teacher"])
    torch.manual_seed(shape.pop("seed"))
    shape["vocab_size"] = 151936
    Qwen3ForCausalLM(Qwen3Config(**shape)).save_pretrained(folder)
    load_qwen_tokenizer().save_pretrained(folder)


@dataclass
class Scenario:
    """Everything the run recorded; the tests assert on it."""

    root: Path
    env: dict
    drivers: dict = field(default_factory=dict)   # name -> CompletedProcess of its driver
    ids: dict = field(default_factory=dict)       # name -> {step: job id}
    jobs: dict = field(default_factory=dict)      # job id -> Job
    events: list = field(default_factory=list)    # (time, text) of what the run did to the jobs
    # array task -> reasons seen while another ran
    pending_reasons: dict = field(default_factory=dict)
    concurrent_tasks: int = 0                     # most sweep array tasks seen running at once
    seconds: float = 0.0

    def runs(self, name: str) -> Path:
        return self.root / name / "runs"

    def data(self, name: str) -> Path:
        return self.root / name / "data"

    def log(self, name: str, step: str) -> str:
        path = self.runs(name) / "logs" / f"{step}-{self.ids[name][step]}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def job(self, name: str, step: str) -> Job:
        return self.jobs[self.ids[name][step]]


def chain_env(sc: Scenario, name: str, **extra) -> dict:
    env = {**sc.env, "HALO_PYTHON": sys.executable, "HALO_VENV": "",
           "VIRTUAL_ENV": str(Path(sys.executable).parents[1]),
           "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HALO_CACHE": os.environ["HALO_CACHE"],
           "HALO_DATA": str(sc.data(name)), "HALO_RUNS": str(sc.runs(name)),
           "HALO_TEACHER": str(sc.root / "teacher"), "HALO_WAIT_POLL": "1",
           "HALO_STAGE1_ARGS": STAGE1_ARGS, "HALO_STAGE2_ARGS": ONE_STEP,
           "HALO_STAGE3_ARGS": ONE_STEP}
    env.update(extra)
    return env


class Driver:
    """A driver running in the background, its output in files (HALO_WAIT=1 keeps it running)."""

    def __init__(self, sc: Scenario, name: str, script: str, env: dict):
        self.out, self.err = sc.root / f"{name}.out", sc.root / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(["bash", str(SLURM / script)], cwd=REPO, env=env,
                                         text=True, stdout=out, stderr=err)

    def ids(self) -> dict[str, str]:
        return submitted_ids(self.out.read_text())

    def result(self) -> subprocess.CompletedProcess:
        self.proc.wait(timeout=60)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode,
                                           self.out.read_text(), self.err.read_text())


def tiny_grid(sc: Scenario) -> Path:
    grid = sc.root / "grid.yaml"
    grid.write_text(json.dumps({"base": str(REPO / "configs" / "tiny" / "pretrain_hypenet.yaml"),
                                "variants": [
                                    {"name": "transformer",
                                     "overrides": ["pretrain.arch=transformer", "model.pe=null",
                                                   "model.logits_scaling_a=null",
                                                   "model.attn_output_gate=false"]},
                                    {"name": "hypenet", "overrides": []}]}))
    return grid


class Watch:
    """Polls Slurm, submits what waits for the chain's data, runs the preemption, and stops once
    every driver ended and no job is pending or running."""

    def __init__(self, sc: Scenario, stop: threading.Event):
        self.sc, self.stop = sc, stop
        self.drivers: dict[str, Driver] = {}
        self.preempt_phase = "wait-data"
        self.resume_step = -1

    def note(self, text: str) -> None:
        self.sc.events.append((time.time(), text))

    def poll(self) -> None:
        for name, driver in self.drivers.items():
            self.sc.ids[name] = driver.ids()
        now, seen = time.time(), scontrol_jobs(self.sc.env)
        for key, job in self.sc.jobs.items():
            job.gone = key not in seen
        for key, f in seen.items():
            job = self.sc.jobs.setdefault(key, Job(key))
            job.fields = f
            mark = (f.get("JobState"), f.get("Restarts"), f.get("Reason"))
            if not job.states or job.states[-1][1:] != mark:
                job.states.append((now, *mark))
        array = self.sc.ids.get("sweep", {}).get("sweep_task")
        if array:
            tasks = {k: f for k, f in seen.items() if k.startswith(f"{array}_")}
            running = [k for k, f in tasks.items() if f.get("JobState") == "RUNNING"]
            self.sc.concurrent_tasks = max(self.sc.concurrent_tasks, len(running))
            if running:
                for k, f in tasks.items():
                    if f.get("JobState") == "PENDING":
                        self.sc.pending_reasons.setdefault(k, set()).add(f.get("Reason"))

    def chain_data_ready(self) -> bool | None:
        """True once the chain's data prep completed; None if it never will."""
        prep = self.sc.jobs.get(self.sc.ids.get("chain", {}).get("prep", ""))
        if prep is not None and prep.state == "COMPLETED":
            return True
        if self.drivers["chain"].proc.poll() is not None and (prep is None or not prep.active):
            return None
        return False

    def submit_on_chain_data(self) -> None:
        sc = self.sc
        data = str(sc.data("chain"))
        # every step but stage 1 is done in this run folder: the driver submits stage 1 alone
        runs = sc.runs("preempt")
        for marker in ("stage2/final/DONE", "stage3/final/DONE", "calibrate/DONE", "export/DONE",
                       "eval/DONE"):
            (runs / marker).parent.mkdir(parents=True, exist_ok=True)
            (runs / marker).touch()
        sc.drivers["preempt"] = subprocess.run(
            ["bash", str(SLURM / "halo_tiny.sh")], cwd=REPO, capture_output=True, text=True,
            timeout=120, env=chain_env(sc, "preempt", HALO_DATA=data, HALO_ATTN_LAYERS="1"))
        sc.ids["preempt"] = submitted_ids(sc.drivers["preempt"].stdout)
        self.preempt_phase = "first-signal" if list(sc.ids["preempt"]) == ["stage1"] else "failed"
        self.drivers["sweep"] = Driver(sc, "sweep", "sweep_scratch.sh", chain_env(
            sc, "sweep", HALO_DATA=data, HALO_SWEEP_GRID=str(tiny_grid(sc)),
            HALO_MAX_CONCURRENT="1", HALO_GPUS_PER_NODE="1", HALO_CPUS_PER_NODE="1",
            HALO_EXCLUSIVE="0", HALO_SWEEP_TOKENIZER=str(sc.root / "teacher"),
            # the teacher's Qwen vocabulary (write_tiny_teacher), not configs/tiny's 4,096 ids
            HALO_SWEEP_ARGS=("schedule.total_steps=6 checkpoint.every_steps=0 "
                             "pretrain.model.vocab_size=151936"),
            HALO_NIAH_LENGTHS="160",
            HALO_NIAH_ARGS="--depths 2 --samples 1 --batch-size 4 --device cpu --dtype fp32"))

    def preempt(self) -> None:
        sc, env = self.sc, self.sc.env
        if self.preempt_phase == "wait-data":
            ready = self.chain_data_ready()
            if ready:
                self.submit_on_chain_data()
            elif ready is None:
                self.preempt_phase = "failed"  # the chain never got its data: the tests say so
            return
        if self.preempt_phase in ("done", "failed"):
            return
        job_id = sc.ids["preempt"]["stage1"]
        job = sc.jobs.get(job_id)
        if job is None:
            return
        # it ended before the next signal was due: the test says how
        if job.state and not job.active:
            self.preempt_phase = "failed"
            return
        step = last_step(sc.runs("preempt") / "stage1")
        if self.preempt_phase == "first-signal" and job.state == "RUNNING" and step >= 3:
            subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=env, check=True)
            self.note(f"scancel --signal=USR1 --batch {job_id} at step {step}")
            self.preempt_phase = "wait-restart"
        elif (self.preempt_phase == "wait-restart" and job.fields.get("Restarts") == "1"
                and job.state == "RUNNING"):
            self.resume_step = step  # the resumed run cut metrics.jsonl back to its checkpoint
            self.preempt_phase = "second-signal"
        elif (self.preempt_phase == "second-signal" and job.state == "RUNNING"
                and step >= self.resume_step + 3):
            subprocess.run(["scontrol", "requeue", job_id], env=env, check=True)
            self.note(f"scontrol requeue {job_id} at step {step}")
            self.preempt_phase = "done"

    def all_over(self) -> bool:
        if any(d.proc.poll() is None for d in self.drivers.values()):
            return False
        if self.preempt_phase not in ("done", "failed"):
            return False
        return not any(j.active for j in self.sc.jobs.values())

    def run(self, t0: float) -> None:
        try:
            while not self.all_over():
                if self.stop.is_set():
                    raise RuntimeError("the session ended before the Slurm scenario did")
                if time.time() - t0 > DEADLINE_S:
                    active = {k: j.state for k, j in self.sc.jobs.items() if j.active}
                    raise AssertionError(f"the Slurm scenario did not end within {DEADLINE_S}s: "
                                         f"{active} still active; preemption {self.preempt_phase}")
                self.poll()
                self.preempt()
                time.sleep(POLL_S)
            self.poll()
            for name, driver in self.drivers.items():
                self.sc.drivers[name] = driver.result()
        except BaseException:
            ours = [j for ids in self.sc.ids.values() for j in ids.values()]
            if ours:  # nothing of ours stays queued
                subprocess.run(["scancel", *ours], env=self.sc.env, capture_output=True)
            raise
        finally:
            self.sc.seconds = time.time() - t0
            (self.sc.root / "timeline.txt").write_text(self.timeline(t0))

    def timeline(self, t0: float) -> str:
        """Every job's state changes and the run's own actions, in seconds from the start (for a
        look)."""
        names = {jid: f"{name}/{step}" for name, ids in self.sc.ids.items()
                 for step, jid in ids.items()}
        rows = [(t, f"job {key} {names.get(key.split('_')[0], '')}: {state} "
                    f"restarts {restarts} ({reason})")
                for key, job in self.sc.jobs.items() for t, state, restarts, reason in job.states]
        rows += self.sc.events
        return "".join(f"{t - t0:7.1f}s {text}\n" for t, text in sorted(rows))


# ------------------------------------------------------------------------------------------------
# The session's one scenario
# ------------------------------------------------------------------------------------------------


class _Run:
    thread: threading.Thread | None = None
    stop = threading.Event()
    scenario: Scenario | None = None
    skip: str | None = None
    error: str | None = None
    brought_up = False  # this session started the local Slurm: it takes it down again


def _main(tmp_path_factory) -> None:
    t0 = time.time()
    try:
        env = base_env()
        problem = not_ready(env)
        if problem is not None:
            if os.geteuid() != 0:
                _Run.skip = (f"no Slurm reachable ({problem}) and not root: `sudo bash "
                             "scripts/local_slurm.sh up` starts one on this machine")
                return
            env["SLURM_CONF"] = local_conf()
            res = subprocess.run(["bash", str(LOCAL_SLURM), "up"], capture_output=True, text=True,
                                 timeout=600)
            if res.returncode != 0:
                raise RuntimeError(f"scripts/local_slurm.sh up failed:\n{res.stdout}\n{res.stderr}")
            _Run.brought_up = True
        root = tmp_path_factory.mktemp("slurm_real")
        sc = Scenario(root=root, env=env)
        subprocess.run([sys.executable, __file__, "teacher", str(root / "teacher")], check=True,
                       capture_output=True, env={**env, "PYTHONPATH": str(REPO)}, timeout=300)
        watch = Watch(sc, _Run.stop)
        watch.drivers["chain"] = Driver(sc, "chain", "halo_tiny.sh",
                                        chain_env(sc, "chain", HALO_WAIT="1"))
        # stage 1 reads held-out shards that do not exist: it fails after its data prep completed
        watch.drivers["fail"] = Driver(sc, "fail", "halo_tiny.sh", chain_env(
            sc, "fail", HALO_WAIT="1",
            HALO_STAGE1_ARGS=f"{STAGE1_ARGS} data.eval={root}/no-such-shards eval.every_steps=2"))
        _Run.scenario = sc
        watch.run(t0)
    except BaseException:
        _Run.error = traceback.format_exc()


def start(tmp_path_factory) -> None:
    """Start the scenario in the background (once per session), in a folder of pytest's temporary
    tree (so pytest's retention policy bounds what failed sessions leave on disk)."""
    if _Run.thread is None:
        _Run.thread = threading.Thread(target=_main, args=(tmp_path_factory,), name="slurm-real",
                                       daemon=True)
        _Run.thread.start()


def result(tmp_path_factory) -> Scenario:
    """The finished scenario; raises pytest's skip or the scenario's own error."""
    import pytest

    start(tmp_path_factory)
    _Run.thread.join()
    if _Run.skip:
        import warnings

        # in the summary even with -q
        warnings.warn(f"the real-Slurm tests are skipped: {_Run.skip}", stacklevel=2)
        pytest.skip(_Run.skip)
    if _Run.error:
        where = f" (its files: {_Run.scenario.root})" if _Run.scenario else ""
        raise AssertionError(f"the real-Slurm scenario failed{where}:\n{_Run.error}")
    return _Run.scenario


def finish(passed: bool) -> None:
    """End of the session: stop a scenario still running, take down a Slurm this session started,
    and delete the scenario's folder unless a test failed."""
    if _Run.thread is None:
        return
    _Run.stop.set()
    _Run.thread.join(timeout=60)
    if _Run.brought_up:
        subprocess.run(["bash", str(LOCAL_SLURM), "down"], capture_output=True, text=True,
                       timeout=120)
    if passed and _Run.scenario is not None:
        shutil.rmtree(_Run.scenario.root, ignore_errors=True)


if __name__ == "__main__" and sys.argv[1:2] == ["teacher"]:
    write_tiny_teacher(sys.argv[2])
