"""Slurm orchestration without a cluster: slurm/halo_*.sh, slurm/sweep_scratch.sh and their helpers.

The scripts run under bash with HALO_DRY_RUN=1, or with fake `sbatch`/`srun`/`scontrol`/`squeue` on
PATH that log their argv (and a few environment variables) and print fake job ids. Checked: the
order of the pipeline's commands, the sbatch dependency chain, the torchrun rendezvous, the job
array, signal forwarding + requeue, skipping finished steps, and bad input stopping before any
submission.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "slurm"
sys.path.insert(0, str(SLURM))

import compare_sweep  # noqa: E402
import sweep_variants  # noqa: E402

PIPELINE_ORDER = ["data_prep.tokenize", "launchers/stage1.py", "select-layers",
                  "launchers/stage2.py", "launchers/stage3.py", "calibrate-scaling",
                  "halo-dist export", "eval-niah", "eval-lm"]
STEPS = ["prep", "stage1", "select", "stage2", "stage3", "calibrate", "export", "eval"]
GRID = sweep_variants.load_grid(REPO / "configs" / "sweeps" / "grid.yaml")[1]

# Fake Slurm tools: each appends "tool<TAB>arg<TAB>arg..." to $SHIM_LOG.
SHIM_HEAD = """#!/bin/bash
{ printf '%s' "$(basename "$0")"; for a in "$@"; do printf '\\t%s' "$a"; done
  printf '\\n'; } >> "$SHIM_LOG"
"""
SHIMS = {
    "sbatch": SHIM_HEAD + """
{ printf 'env\\tHALO_STEP=%s\\tHALO_DATA=%s\\tHALO_RUNS=%s\\tHALO_TEACHER=%s' \\
    "${HALO_STEP:-}" "${HALO_DATA:-}" "${HALO_RUNS:-}" "${HALO_TEACHER:-}"
  printf '\\tHALO_REPO=%s\\tHALO_SWEEP_PENDING=%s\\tSLURM_CPUS_PER_TASK=%s\\n' \\
    "${HALO_REPO:-}" "${HALO_SWEEP_PENDING:-}" "${SLURM_CPUS_PER_TASK:-}"; } >> "$SHIM_LOG"
n=$(cat "$SHIM_LOG.count" 2>/dev/null || echo 1000); echo $((n + 1)) > "$SHIM_LOG.count"
echo "$n"
""",
    "scontrol": SHIM_HEAD + """
[[ $1 == show && $2 == hostnames ]] && printf 'gpu-node07\\ngpu-node08\\ngpu-node09\\n'
exit 0
""",
    "squeue": SHIM_HEAD + 'printf "%s" "${FAKE_SQUEUE:-}"\n',
    # srun: FAKE_SRUN = ok | fail | finish (write the step's outputs) | wait (run until a signal)
    "srun": SHIM_HEAD + """
printf 'srun-env\\tTORCHELASTIC_SIGNALS_TO_HANDLE=%s\\tTORCH_ELASTIC_SHUTDOWN_TIMEOUT=%s\\n' \\
    "${TORCHELASTIC_SIGNALS_TO_HANDLE:-}" "${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-}" >> "$SHIM_LOG"
case ${FAKE_SRUN:-ok} in
  fail) exit 3 ;;
  wait)
    trap 'echo "srun-got	USR1" >> "$SHIM_LOG"; exit 0' USR1
    trap 'echo "srun-got	TERM" >> "$SHIM_LOG"; exit 0' TERM
    touch "$SHIM_LOG.started"
    for _ in $(seq 200); do sleep 0.05; done
    exit 0 ;;
  finish)
    prev=""
    for a in "$@"; do
      case $a in logging.run_dir=*) mkdir -p "${a#*=}/final"; touch "${a#*=}/final/DONE" ;; esac
      if [[ $prev == --output-dir ]]; then
        mkdir -p "$a"
        echo '{"summary": {"niah_single_1": {"by_length": {"4096": 1.0, "262144": 0.25}}}}' \\
          > "$a/niah.json"
      fi
      prev=$a
    done ;;
esac
exit 0
""",
}

# Stand-in for the layout check `python -m halo_dist.config ... --world-size N` (one Python start-up
# per variant; the real check of every grid variant is
# test_sweep_dry_run_commands_are_valid_pretrain_runs and
# tests/test_config.py::test_every_sweep_variant_validates): global batch 128, micro batch 4.
FAKE_CHECK = """#!/bin/bash
w=""; while (($#)); do [[ $1 == --world-size ]] && w=$2; shift; done
(( 128 % (w * 4) == 0 )) || {
  echo "invalid config: data.global_batch_size: 128 is not divisible by 4x$w" >&2; exit 2; }
"""


@pytest.fixture
def slurm_env(tmp_path):
    """Fake Slurm on PATH, scratch data/run folders, a clean environment; returns (env, log
    path)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in SHIMS.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    (bin_dir / "fake_check").write_text(FAKE_CHECK)
    (bin_dir / "fake_check").chmod(0o755)
    log = tmp_path / "shim.log"
    log.touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HALO_", "SLURM_", "SBATCH_"))}
    env.update(PATH=f"{bin_dir}:{Path(sys.executable).parent}:{env.get('PATH', '')}",
               SHIM_LOG=str(log), HALO_PYTHON=sys.executable, HALO_DATA=str(tmp_path / "data"),
               HALO_RUNS=str(tmp_path / "runs"), HALO_TEACHER="Qwen/Qwen3-8B", HALO_VENV="",
               # no cached teacher configs
               HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hf" / "hub"))
    # no re-activation
    env["VIRTUAL_ENV"] = env.get("VIRTUAL_ENV") or str(Path(sys.executable).parents[1])
    return env, log


def run(script: str, env: dict, *args: str, **extra) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SLURM / script), *args], env={**env, **extra}, cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def calls(log: Path, tool: str) -> list[list[str]]:
    rows = [line.split("\t") for line in log.read_text().splitlines()]
    return [r[1:] for r in rows if r[0] == tool]


def flag(argv: list[str], name: str) -> str | None:
    """Value of --name=value in an argv, or None."""
    hits = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    return hits[-1] if hits else None


def complete_manifest(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps({"complete": True, "splits": {}}))


# ------------------------------------------------------------------------------------------------
# HALO pipeline: driver
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size,config_dir",
                         [("8b", "configs/stages/9b"), ("5b", "configs/stages/5b"),
                          ("2b", "configs/stages/2b"), ("tiny", "configs/tiny/slurm")])
def test_dry_run_prints_every_command_in_order(slurm_env, size, config_dir):
    env, log = slurm_env
    res = run(f"halo_{size}.sh", env, HALO_DRY_RUN="1")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    positions = [out.find(marker) for marker in PIPELINE_ORDER]
    assert all(p >= 0 for p in positions), dict(zip(PIPELINE_ORDER, positions))
    assert positions == sorted(positions), "pipeline commands out of order"
    assert out.count("+ sbatch ") == len(STEPS)
    assert f"--config {config_dir}/stage2.yaml" in out
    assert "--dependency=afterok:dry-stage2" in out  # stage 3 waits for stage 2
    assert "nothing was submitted" in out
    assert log.read_text() == "", "a dry run must not call any Slurm tool"


def test_data_prep_reads_another_corpus(slurm_env):
    env, log = slurm_env
    res = run("halo_2b.sh", env, HALO_DRY_RUN="1", HALO_PREP_SOURCE="--input corpus/*.jsonl.gz",
              HALO_PREP_ARGS="--text-field body --max-docs 10")
    assert res.returncode == 0, res.stderr
    (prep,) = [line for line in res.stdout.splitlines() if "data_prep.tokenize" in line]
    assert ("--input 'corpus/*.jsonl.gz' --tokenizer Qwen/Qwen3-8B" in prep
            and "--hf-dataset" not in prep)
    assert prep.endswith("--text-field body --max-docs 10")


def test_submission_chain_dependencies_resources_and_environment(slurm_env):
    env, log = slurm_env
    res = run("halo_8b.sh", env, "-p", "gpu", "--account=proj", "--time=12:00:00", "--qos=high",
              "--mail-type=END")
    assert res.returncode == 0, res.stderr
    subs = calls(log, "sbatch")
    assert [flag(a, "job-name") for a in subs] == [f"halo-8b-{s}" for s in STEPS]
    assert [flag(a, "export") for a in subs] == [f"ALL,HALO_STEP={s}" for s in STEPS]
    ids = [str(1000 + i) for i in range(len(STEPS))]  # the fake sbatch counts from 1000
    assert flag(subs[0], "dependency") is None
    for i, argv in enumerate(subs[1:], 1):
        assert flag(argv, "dependency") == f"afterok:{ids[i - 1]}", (STEPS[i], argv)
        assert "--kill-on-invalid-dep=yes" in argv
    for argv in subs:
        assert argv[-1] == str(SLURM / "halo_8b.sh")
        assert flag(argv, "partition") == "gpu" and flag(argv, "account") == "proj"
        assert (flag(argv, "time") == "12:00:00" and flag(argv, "qos") == "high"
                and "--mail-type=END" in argv)
        assert "--requeue" in argv and flag(argv, "signal") == "B:USR1@300"
        assert flag(argv, "output").startswith(env["HALO_RUNS"] + "/logs/")
    stage2 = subs[STEPS.index("stage2")]
    assert (flag(stage2, "nodes") == "1" and flag(stage2, "gpus-per-node") == "8"
            and "--ntasks-per-node=1" in stage2)
    assert flag(subs[0], "gpus-per-node") is None  # data prep asks for CPUs only
    for row in calls(log, "env"):  # the step jobs inherit absolute paths
        kv = dict(x.split("=", 1) for x in row)
        assert kv["HALO_DATA"] == env["HALO_DATA"] and kv["HALO_RUNS"] == env["HALO_RUNS"]
        assert kv["HALO_TEACHER"] == "Qwen/Qwen3-8B" and kv["HALO_REPO"] == str(REPO)
    assert (Path(env["HALO_RUNS"]) / "logs").is_dir()


def test_resubmission_skips_finished_steps(slurm_env, tmp_path):
    env, log = slurm_env
    runs = Path(env["HALO_RUNS"])
    complete_manifest(Path(env["HALO_DATA"]))
    for marker in ("stage1/final/DONE", "select/DONE"):
        (runs / marker).parent.mkdir(parents=True, exist_ok=True)
        (runs / marker).touch()
    res = run("halo_8b.sh", env)
    assert res.returncode == 0, res.stderr
    subs = calls(log, "sbatch")
    assert [flag(a, "job-name") for a in subs] == [f"halo-8b-{s}" for s in STEPS[3:]]
    assert flag(subs[0], "dependency") is None and flag(subs[1], "dependency") == "afterok:1000"
    assert "skip stage1" in res.stdout and "skip prep" in res.stdout


def test_queued_chain_for_the_same_runs_is_refused(slurm_env):
    env, log = slurm_env
    res = run("halo_8b.sh", env, FAKE_SQUEUE=f"77|halo-8b-stage2|halo:{env['HALO_RUNS']}\n")
    assert res.returncode == 2 and "already queued or running" in res.stderr
    assert calls(log, "sbatch") == []
    # another folder
    res = run("halo_8b.sh", env, FAKE_SQUEUE=f"78|halo-8b-stage2|halo:{env['HALO_RUNS']}-v2\n")
    assert res.returncode == 0, res.stderr


def test_missing_environment_stops_before_submitting(slurm_env):
    env, log = slurm_env
    for var in ("HALO_DATA", "HALO_RUNS", "HALO_TEACHER"):
        env.pop(var)
    res = run("halo_8b.sh", env)
    assert res.returncode == 2
    for var in ("HALO_DATA", "HALO_RUNS", "HALO_TEACHER"):
        assert var in res.stderr
    assert "nothing was submitted" in res.stderr
    assert calls(log, "sbatch") == []


@pytest.mark.parametrize("extra,message", [
    # real config dry-run
    ({"HALO_NODES": "3"}, "stage1 (3 node(s) x 8 GPUs) does not fit 24 GPU rank(s)"),
    ({"HALO_NODES": "two"}, "HALO_NODES=two must be a positive integer"),
    ({"HALO_TEACHER": "/no/such/teacher"}, "is not a model folder"),
])
def test_bad_input_stops_before_submitting(slurm_env, extra, message):
    env, log = slurm_env
    res = run("halo_8b.sh", env, **extra)
    assert res.returncode == 2, res.stdout
    assert message in res.stderr
    assert calls(log, "sbatch") == []


def test_two_nodes_fit_every_stage_with_a_smaller_micro_batch(slurm_env):
    """data.fit_micro_batch: stage 1's 32 sequences over 16 ranks run at micro 2 (real config
    checks)."""
    env, log = slurm_env
    res = run("halo_8b.sh", env, HALO_NODES="2", HALO_DRY_RUN="1")
    assert res.returncode == 0, res.stderr
    assert ("stage1 (2 node(s) x 8 GPUs): micro batch 4 -> 2 on 16 ranks (global batch 32 "
            "unchanged)" in res.stdout)
    assert ("stage2 (2 node(s) x 8 GPUs): micro batch 4 -> 3 on 16 ranks (global batch 96 "
            "unchanged)" in res.stdout)
    # stage 3 would read the short-context shards: said up front
    assert "set HALO_DATA_LONG" in res.stdout


def test_teacher_of_another_size_is_refused_before_data_prep(slurm_env, tmp_path):
    env, log = slurm_env
    teacher = tmp_path / "qwen3-1.7b"
    teacher.mkdir()
    (teacher / "config.json").write_text(json.dumps({"num_hidden_layers": 28}))
    res = run("halo_5b.sh", env, HALO_TEACHER=str(teacher))
    assert res.returncode == 2
    assert "has 28 layers but the stage configs are sized for a 36-layer teacher" in res.stderr
    assert calls(log, "sbatch") == []
    # the right size
    assert run("halo_2b.sh", env, HALO_TEACHER=str(teacher), HALO_DRY_RUN="1").returncode == 0


def test_teacher_depth_check_is_best_effort(slurm_env):
    """A HALO_PYTHON without halo_dist (layouts checked by a custom command) only skips the depth
    check."""
    env, log = slurm_env
    res = run("halo_8b.sh", sweep_env(env, None), HALO_PYTHON="false", HALO_DRY_RUN="1")
    assert res.returncode == 0, res.stderr
    assert "WARNING: teacher depth not checked" in res.stdout


def test_bad_node_count_from_sbatch_flag(slurm_env):
    env, log = slurm_env
    res = run("halo_2b.sh", env, "-N", "3")
    assert (res.returncode == 2 and "does not fit 24 GPU rank(s)" in res.stderr
            and "micro_batch_size" in res.stderr)
    assert calls(log, "sbatch") == []


# ------------------------------------------------------------------------------------------------
# HALO pipeline: inside a step job
# ------------------------------------------------------------------------------------------------


def step_env(env: dict, step: str, **extra) -> dict:
    return {**env, "HALO_STEP": step, "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": "gpu-node[07-09]", "SLURM_NNODES": "3", "HALO_GPUS_PER_NODE": "8",
            **extra}


def test_stage_job_rendezvous_and_selected_layers(slurm_env):
    env, log = slurm_env
    runs = Path(env["HALO_RUNS"])
    (runs / "select").mkdir(parents=True)
    (runs / "select" / "selection.json").write_text(
        json.dumps({"attn_layers": [2, 3, 6], "method": "halo"}))
    res = run("halo_8b.sh", step_env(env, "stage2", FAKE_SRUN="finish"))
    assert res.returncode == 0, res.stderr
    assert calls(log, "scontrol")[0] == ["show", "hostnames", "gpu-node[07-09]"]
    (argv,) = calls(log, "srun")
    i = argv.index("torchrun")
    assert argv[:i] == ["--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                        "--cpu-bind=none"]
    assert argv[i + 1:i + 13] == ["--nnodes", "3", "--nproc_per_node", "8", "--rdzv_backend",
                                  "c10d", "--rdzv_endpoint", "gpu-node07:19242", "--rdzv_id",
                                  "4242", "--max_restarts", "0"]
    assert argv[i + 13:i + 16] == ["launchers/stage2.py", "--config",
                                   "configs/stages/9b/stage2.yaml"]
    assert {"model.attn_layers=2,3,6", f"model.stage1_weights={runs}/stage1/final",
            f"data.train={env['HALO_DATA']}", f"logging.run_dir={runs}/stage2"} <= set(argv)
    (srun_env,) = calls(log, "srun-env")
    assert "TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in srun_env
    assert calls(log, "scontrol")[1:] == []  # finished: no requeue
    (runs / "stage2" / "final" / "DONE").unlink()
    res = run("halo_8b.sh", step_env(env, "stage2", FAKE_SRUN="finish", HALO_RDZV_PORT="29500"))
    assert res.returncode == 0 and "gpu-node07:29500" in calls(log, "srun")[-1]


@pytest.mark.parametrize("forward,expected", [("", "USR1"), ("TERM", "TERM")])
def test_stage_job_forwards_signal_and_requeues(slurm_env, forward, expected):
    env, log = slurm_env
    job_env = step_env(env, "stage1", FAKE_SRUN="wait", HALO_FORWARD_SIGNAL=forward)
    proc = subprocess.Popen(["bash", str(SLURM / "halo_8b.sh")], env=job_env,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = Path(str(log) + ".started")
    deadline = time.time() + 10
    while not started.exists() and time.time() < deadline:
        time.sleep(0.02)
    assert started.exists(), "fake srun never started"
    time.sleep(0.1)  # let bash reach `wait`
    proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 delivers to the batch shell
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert calls(log, "srun-got") == [[expected]]
    assert ["requeue", "4242"] in calls(log, "scontrol")
    assert f"received SIGUSR1: forwarding SIG{expected}" in out


def test_stage_job_requeues_when_trainer_stops_without_done(slurm_env):
    env, log = slurm_env  # e.g. SIGTERM delivered straight to the ranks: they checkpoint and exit 0
    res = run("halo_8b.sh", step_env(env, "stage3", FAKE_SRUN="ok", HALO_ATTN_LAYERS="1,2"))
    assert res.returncode == 0, res.stderr
    assert ["requeue", "4242"] in calls(log, "scontrol")


def test_stage_job_skips_when_done_and_fails_without_requeue(slurm_env):
    env, log = slurm_env
    done = Path(env["HALO_RUNS"]) / "stage1" / "final" / "DONE"
    done.parent.mkdir(parents=True)
    done.touch()
    res = run("halo_8b.sh", step_env(env, "stage1"))
    assert res.returncode == 0 and "skip stage1" in res.stdout
    assert calls(log, "srun") == [] and calls(log, "scontrol") == []
    done.unlink()
    res = run("halo_8b.sh", step_env(env, "stage1", FAKE_SRUN="fail"))
    assert res.returncode == 3 and "step stage1 failed" in res.stderr
    assert all(c[0] != "requeue" for c in calls(log, "scontrol"))


def test_eval_step_uses_the_exported_model_and_marks_done(slurm_env):
    env, log = slurm_env
    res = run("halo_8b.sh", step_env(env, "eval", SLURM_NNODES="1"))
    assert res.returncode == 0, res.stderr
    niah, csr = calls(log, "srun")
    model = f"{env['HALO_RUNS']}/export/hypenet-9b"
    assert niah[3:5] == ["halo-dist", "eval-niah"] and niah[niah.index("--model") + 1] == model
    assert niah[niah.index("--lengths") + 1] == "4K,8K,16K,32K,64K,128K,256K"
    assert csr[3:5] == ["halo-dist", "eval-lm"]
    assert (Path(env["HALO_RUNS"]) / "eval" / "DONE").exists()


def test_default_csr_tasks_run_offline_and_hub_tasks_are_named_before_submission(slurm_env):
    """The eval step's default tasks are eval-lm's saved sets; any other task is named up front."""
    from halo_dist.eval.olmo_sets import SETS

    env, log = slurm_env
    res = run("halo_8b.sh", env, HALO_DRY_RUN="1")
    assert res.returncode == 0, res.stderr
    assert (f"--tasks {','.join(SETS)}" in res.stdout
            and "need the Hugging Face hub" not in res.stdout)
    res = run("halo_8b.sh", env, HALO_DRY_RUN="1", HALO_CSR_TASKS="arc_easy,mmlu,boolq")
    note = next(line for line in res.stdout.splitlines() if "need the Hugging Face hub" in line)
    assert "mmlu,boolq" in note and "arc_easy," not in note.split("offline:")[0]
    assert res.stdout.index(note) < res.stdout.index("+ sbatch ")


# ------------------------------------------------------------------------------------------------
# From-scratch sweep
# ------------------------------------------------------------------------------------------------


def sweep_env(env: dict, tmp_path: Path, **extra) -> dict:
    return {**env, "HALO_CONFIG_CHECK": str(Path(env["SHIM_LOG"]).parent / "bin" / "fake_check"),
            **extra}


def dry_run_tasks(stdout: str) -> dict[str, list[str]]:
    """{variant: argv of its training command} from a sweep dry run's '[array task i] NAME'
    blocks."""
    import shlex

    tasks, lines = {}, stdout.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("  [array task "):
            tasks[line.split("] ", 1)[1]] = shlex.split(lines[i + 1].strip().removeprefix("+ "))
    return tasks


def test_sweep_dry_run_commands_are_valid_pretrain_runs(slurm_env, tmp_path):
    """Every grid variant's printed command is launchers/pretrain.py with the grid's overrides, and
    it resolves to a valid pretrain config (the same check --check and the launcher run first)."""
    from halo_dist.config import load_config

    env, log = slurm_env
    res = run("sweep_scratch.sh", sweep_env(env, tmp_path), HALO_DRY_RUN="1")
    assert res.returncode == 0, res.stderr
    tasks = dry_run_tasks(res.stdout)
    assert list(tasks) == [n for n, _ in GRID]
    for name, overrides in GRID:
        argv = tasks[name]
        script = argv.index("launchers/pretrain.py")
        args = argv[script + 1:]
        assert args[:2] == ["--config", "configs/sweeps/base_500m.yaml"]
        assert args[2:2 + len(overrides)] == overrides
        assert (args[2 + len(overrides):] == ["pretrain.model.tokenizer=openai-community/gpt2",
                                              f"data.train={env['HALO_DATA']}",
                                              f"logging.run_dir={env['HALO_RUNS']}/{name}"])
        cfg = load_config(REPO / args[1], args[2:])
        assert cfg.stage.name == "pretrain" and cfg.logging.run_dir.endswith(name)
        cfg.validate_against_world(8)
    assert log.read_text() == ""


def test_sweep_real_layout_check_and_bad_variant(slurm_env, tmp_path):
    """The driver's real config check (python -m halo_dist.config) passes for grid variants and
    stops a bad variant name before anything is submitted or printed as submitted, dry run or
    not."""
    env, log = slurm_env
    real = {k: v for k, v in sweep_env(env, tmp_path).items() if k != "HALO_CONFIG_CHECK"}
    res = run("sweep_scratch.sh", real, HALO_DRY_RUN="1",
              HALO_VARIANTS="transformer,swan-gpt,hypenet-gdn-hype")
    assert res.returncode == 0, res.stderr
    assert "batch layouts fit" in res.stdout
    assert list(dry_run_tasks(res.stdout)) == ["transformer", "swan-gpt", "hypenet-gdn-hype"]
    for dry in ("1", "0"):
        res = run("sweep_scratch.sh", real, HALO_DRY_RUN=dry,
                  HALO_VARIANTS="transformer,hypenet-lstm-hype")
        assert res.returncode == 2 and "unknown sweep variant(s) hypenet-lstm-hype" in res.stderr
        assert "nothing was submitted" in res.stderr and "sbatch" not in res.stdout
    assert calls(log, "sbatch") == []


def test_grid_variants_and_scaling_base():
    names = [n for n, _ in GRID]
    assert len(names) == 2 + 4 * 5 and names[:2] == ["transformer", "swan-gpt"]
    ov = dict(GRID)
    assert "model.logits_scaling_a=300" in ov["hypenet-lightning-hype"]
    assert "model.logits_scaling_a=1000" in ov["hypenet-lightning-all-nope"]
    assert "model.logits_scaling_a=5000" in ov["hypenet-rwkv7-hype"]
    assert ("model.logits_scaling_a=1000" in ov["swan-gpt"]
            and "model.logits_scaling_a=null" in ov["transformer"])
    assert "model.attn_layers=0,4,8,12,16,20,24" in ov["hypenet-gla-hype"]
    assert sweep_variants.main(["overrides", "1", "--among", "transformer,hypenet-gdn-hype"]) == 0
    with pytest.raises(sweep_variants.GridError, match="unknown sweep variant"):
        sweep_variants.select(GRID, "transformer,nope")


def test_sweep_dry_run_full_grid(slurm_env, tmp_path):
    env, log = slurm_env
    res = run("sweep_scratch.sh", sweep_env(env, tmp_path), HALO_DRY_RUN="1")
    assert res.returncode == 0, res.stderr
    assert ("--array=0-21%4" in res.stdout
            and "--output=" + env["HALO_RUNS"] + "/logs/sweep-%A_%a.log" in res.stdout)
    tasks = [line.split("] ")[1]
             for line in res.stdout.splitlines() if line.startswith("  [array task ")]
    assert tasks == [n for n, _ in GRID]
    assert "--hf-config sample-100BT --tokenizer openai-community/gpt2" in res.stdout
    assert "compare_sweep.py" in res.stdout and log.read_text() == ""


def test_sweep_submission_subset(slurm_env, tmp_path):
    env, log = slurm_env
    names = ["transformer", "hypenet-lightning-hype", "hypenet-mamba2-all-nope"]
    # already trained: not in the array
    done = Path(env["HALO_RUNS"]) / "swan-gpt" / "final" / "DONE"
    done.parent.mkdir(parents=True)
    done.touch()
    res = run("sweep_scratch.sh",
              sweep_env(env, tmp_path, HALO_VARIANTS=",".join(names + ["swan-gpt"]),
                        HALO_MAX_CONCURRENT="2"), "-p", "gpu")
    assert res.returncode == 0, res.stderr
    prep, array, evaljob = calls(log, "sbatch")
    assert flag(prep, "export") == "ALL,HALO_STEP=sweep_prep"
    assert flag(array, "array") == "0-2%2" and flag(array, "dependency") == "afterok:1000"
    assert flag(array, "output").endswith("/logs/sweep-%A_%a.log") and "--requeue" in array
    assert (flag(evaljob, "dependency") == "afterany:1001"
            and flag(evaljob, "export") == "ALL,HALO_STEP=sweep_eval")
    envs = [dict(x.split("=", 1) for x in row) for row in calls(log, "env")]
    assert envs[1]["HALO_SWEEP_PENDING"] == ",".join(names)


@pytest.mark.parametrize("index", [0, 2])
def test_sweep_array_task_trains_its_variant(slurm_env, tmp_path, index):
    env, log = slurm_env
    names = ["transformer", "swan-gpt", "hypenet-gdn-all-rope"]
    res = run("sweep_scratch.sh",
              sweep_env(env, tmp_path, HALO_STEP="sweep_task", SLURM_ARRAY_TASK_ID=str(index),
                        SLURM_JOB_ID="555", SLURM_JOB_NODELIST="gpu-node07", SLURM_NNODES="1",
                        HALO_SWEEP_PENDING=",".join(names), FAKE_SRUN="finish"))
    assert res.returncode == 0, res.stderr
    (argv,) = calls(log, "srun")
    name = names[index]
    assert f"logging.run_dir={env['HALO_RUNS']}/{name}" in argv
    tokenizer = "pretrain.model.tokenizer=openai-community/gpt2"  # the one data prep used
    assert ([a for a in argv if a.startswith(("model.", "pretrain."))]
            == dict(GRID)[name] + [tokenizer])
    assert argv[argv.index("--config") + 1] == "configs/sweeps/base_500m.yaml"
    assert f"variant {name}" in res.stdout


def test_sweep_bad_input(slurm_env, tmp_path):
    env, log = slurm_env
    res = run("sweep_scratch.sh",
              sweep_env(env, tmp_path, HALO_VARIANTS="transformer,no-such-variant"))
    assert res.returncode == 2 and "unknown sweep variant(s) no-such-variant" in res.stderr
    res = run("sweep_scratch.sh", sweep_env(env, tmp_path, HALO_GPUS_PER_NODE="3"))
    assert res.returncode == 2 and "does not fit 3 GPU rank(s)" in res.stderr
    res = run("sweep_scratch.sh", sweep_env(env, tmp_path, HALO_MAX_CONCURRENT="0"))
    assert res.returncode == 2 and "HALO_MAX_CONCURRENT" in res.stderr
    env.pop("HALO_RUNS")
    res = run("sweep_scratch.sh", sweep_env(env, tmp_path))
    assert res.returncode == 2 and "HALO_RUNS" in res.stderr
    assert calls(log, "sbatch") == []


def test_sweep_eval_job_writes_table_and_plot(slurm_env, tmp_path):
    env, log = slurm_env
    runs = Path(env["HALO_RUNS"])
    for name in ("transformer", "hypenet-lightning-hype"):
        (runs / name / "final").mkdir(parents=True)
        (runs / name / "final" / "DONE").touch()
    res = run("sweep_scratch.sh",
              sweep_env(env, tmp_path, HALO_STEP="sweep_eval", SLURM_JOB_ID="9",
                        HALO_SWEEP_ALL="transformer,hypenet-lightning-hype,swan-gpt",
                        FAKE_SRUN="finish"))
    assert res.returncode == 0, res.stderr
    assert len(calls(log, "srun")) == 2  # swan-gpt has no trained model
    table = (runs / "sweep_niah.md").read_text()
    assert ("| transformer | 100.0 | 25.0 | 62.5 |" in table and "| swan-gpt |" in table
            and "missing" in table)
    assert (runs / "sweep_niah.png").stat().st_size > 1000


def test_compare_reader_is_tolerant():
    read = compare_sweep.accuracy_by_length
    halo_report = {"config": {"lengths": [4096]}, "records": [], "summary": {
        "niah_single_1": {"by_length": {"4096": 1.0, "8192": 0.5}, "by_cell": {}, "mean": 0.75},
        "niah_single_2": {"by_length": {"4096": 0.5, "8192": 0.5}, "by_cell": {}, "mean": 0.5}}}
    assert read(halo_report) == {4096: 0.75, 8192: 0.5}
    assert read({"4K": 99.0, "256K": 50}) == {4096: 0.99, 262144: 0.5}
    assert read({"accuracy": {"niah_4k": {"acc": 0.9}}}) == {4096: 0.9}
    assert (read([{"length": 4096, "correct": True}, {"length": 4096, "correct": False}])
            == {4096: 0.5})
    assert read({"model": "x"}) == {}


def test_driver_inside_a_job_inherits_allocation_and_clears_slurm_env(slurm_env):
    env, log = slurm_env  # `sbatch -p gpu -A proj slurm/halo_5b.sh`
    res = run("halo_5b.sh", env, SLURM_JOB_ID="31", SLURM_JOB_PARTITION="gpu",
              SLURM_JOB_ACCOUNT="proj", SLURM_JOB_NUM_NODES="1", SLURM_SUBMIT_DIR=str(REPO),
              SLURM_CPUS_PER_TASK="2")
    assert res.returncode == 0, res.stderr
    subs = calls(log, "sbatch")
    assert len(subs) == len(STEPS)
    assert all(flag(a, "partition") == "gpu" and flag(a, "account") == "proj" for a in subs)
    # not leaked into step jobs
    assert all(row[-1] == "SLURM_CPUS_PER_TASK=" for row in calls(log, "env"))


def test_given_attention_layers_skip_selection(slurm_env):
    env, log = slurm_env
    res = run("halo_8b.sh", env, HALO_DRY_RUN="1", HALO_ATTN_LAYERS="1,2,4,6,7,10,24,33,34")
    assert res.returncode == 0, res.stderr
    assert "select-layers" not in res.stdout and "skip select" in res.stdout
    assert "model.attn_layers=1,2,4,6,7,10,24,33,34" in res.stdout
    assert "--dependency=afterok:dry-stage1" in res.stdout  # stage 2 now waits for stage 1
