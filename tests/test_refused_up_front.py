"""Inputs a run cannot use are refused before anything is built, each with one ``error:`` line that
names the key or file: non-finite and absurd values (at validation, so ``--dry-run`` refuses them
too), a YAML key given twice, a ``--config`` that is a directory or not UTF-8, a launcher
environment with ``RANK`` but not the rest, a hub id that is not in the cache while offline, and a
teacher or ``student_init`` folder that carries code halo_dist did not write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from halo_dist.config import ConfigError, config_from_dict, load_config, parse_run_args
from halo_dist.errors import HaloUserError

REPO = Path(__file__).resolve().parents[1]
TINY_STAGE2 = REPO / "configs" / "tiny" / "stage2.yaml"
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def minimal(**sections) -> dict:
    raw = {
        "stage": {"name": "stage2"},
        "model": {"teacher": "Qwen/Qwen3-1.7B", "num_layers": 28, "attn_layers": [2, 3, 6]},
        "data": {"train": "shards/", "seq_len": 512, "global_batch_size": 96,
                 "micro_batch_size": 12},
        "optim": {"lr": 1e-4},
        "schedule": {"kind": "cosine", "total_steps": 1000},
    }
    raw.update(sections)
    return raw


# --- values ------------------------------------------------------------------------------------

@pytest.mark.parametrize("override, key, text", [
    ("optim.lr=inf", "optim.lr", "must be a finite number, got inf"),
    ("optim.lr=nan", "optim.lr", "must be a finite number, got nan"),
    ("optim.min_lr=nan", "optim.min_lr", "must be a finite number, got nan"),
    ("optim.lr=-inf", "optim.lr", "finite"),
    ("optim.eps=inf", "optim.eps", "finite"),
    ("loss.temperature=nan", "loss.temperature", "finite"),
    ("optim.grad_clip=inf", "optim.grad_clip", "finite"),
    ("optim.lr=3", "optim.lr", "must be <= 1"),
    ("optim.lr=1e9", "optim.lr", "must be <= 1"),
    ("schedule.total_steps=-5", "schedule.total_steps", "must be > 0"),
    ("schedule.total_steps=1e15", "schedule.total_steps", "at most 1,000,000,000"),
    ("schedule.total_steps=1e400", "schedule.total_steps", "expected an integer"),
])
def test_non_finite_and_absurd_values_are_refused_at_validation(override, key, text):
    with pytest.raises(ConfigError) as excinfo:
        config_from_dict(minimal(), [override])
    found = dict(excinfo.value.problems)
    assert key in found and text in found[key], found


def test_absurd_token_budgets_and_opd_learning_rates_are_refused():
    raw = minimal(schedule={"kind": "cosine", "total_tokens": "1e16"})
    with pytest.raises(ConfigError,
                       match=r"schedule.total_tokens: .*at most 1,000,000,000,000,000"):
        config_from_dict(raw)
    with pytest.raises(ConfigError, match=r"optim.lr: .*finite"):
        config_from_dict(minimal(optim={"lr": float("inf")}))  # YAML's .inf
    with pytest.raises(ConfigError, match=r"opd.rnn_lr: must be <= 1"):
        load_config(REPO / "configs" / "opd" / "tiny.yaml", ["opd.rnn_lr=5"])


def test_dry_run_refuses_a_non_finite_learning_rate(capsys):
    with pytest.raises(SystemExit) as excinfo:
        parse_run_args(["--config", str(TINY_STAGE2), "optim.lr=inf", "--dry-run"])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "error: invalid config: optim.lr: must be a finite number, got inf" in err, err


# --- YAML files ----------------------------------------------------------------------------------

def test_a_key_given_twice_is_refused_naming_the_key_file_and_lines(tmp_path):
    raw = minimal()
    del raw["optim"]
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 1.0e-4\n  betas: [0.9, 0.95]\n  lr: 1.0e-2\n"
                    + yaml.safe_dump(raw))
    assert yaml.safe_load(path.read_text())["optim"]["lr"] == 1e-2  # what YAML alone does
    with pytest.raises(ConfigError) as excinfo:
        load_config(path)
    message = str(excinfo.value)
    assert (f"{path}: optim.lr is given twice (lines 2 and 4)" in message
            and "keeps only the last" in message), message
    # in a base file too, and at the top level
    (tmp_path / "base.yaml").write_text("optim: {lr: 1.0e-4}\noptim: {lr: 2.0e-4}\n")
    (tmp_path / "top.yaml").write_text(yaml.safe_dump({**minimal(), "base": "base.yaml"}))
    with pytest.raises(ConfigError, match=r"base\.yaml: optim is given twice \(lines 1 and 2\)"):
        load_config(tmp_path / "top.yaml")


def test_a_directory_or_a_binary_file_as_config_is_one_error(tmp_path, capsys):
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(b"\x89\xff\xfe\x00weights")
    for path, text in ((tmp_path, "is a directory, not a YAML config file"),
                       (binary, "is not UTF-8 text")):
        with pytest.raises(ConfigError, match=text):
            load_config(path)
        with pytest.raises(SystemExit) as excinfo:
            parse_run_args(["--config", str(path), "--dry-run"])
        assert excinfo.value.code == 2
        err = capsys.readouterr().err
        assert f"error: invalid config: {path} {text}" in err and "Traceback" not in err, err


# --- the launcher's environment and the model sources -----------------------------------------

def run_launcher(tmp_path, *overrides, env=None):
    clean = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    clean.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})})
    return subprocess.run([sys.executable, str(REPO / "launchers" / "stage2.py"), "--config",
                           str(TINY_STAGE2), f"logging.run_dir={tmp_path / 'run'}", *overrides],
                          capture_output=True, text=True, timeout=300, env=clean, cwd=REPO)


def one_error(res) -> str:
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.stderr[-3000:]
    return errors[0]


@pytest.mark.slow
def test_rank_alone_is_refused_naming_the_missing_variables(tmp_path):
    """Before: DeepSpeed fell back to MPI discovery (an mpi4py traceback)."""
    line = one_error(run_launcher(tmp_path, env={"RANK": "1"}))
    assert "RANK is set" in line and "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT" in line
    assert "torchrun" in line
    assert not (tmp_path / "run").exists()


def launched(tmp_path, capsys, *overrides) -> str:
    """``launchers/stage2.py`` in this process (``launch``): its one ``error:`` line."""
    from halo_dist.launch import launch

    code = launch("stage2", argv=["--config", str(TINY_STAGE2),
                                  f"logging.run_dir={tmp_path / 'run'}", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_a_hub_id_missing_from_the_offline_cache_is_refused_before_the_build(tmp_path, capsys):
    """Before: an OSError traceback from transformers once the teacher was loaded."""
    line = launched(tmp_path, capsys, "model.teacher=halo-test/not-downloaded",
                    "model.random_teacher=null")
    assert ("model.teacher: halo-test/not-downloaded is not in the Hugging Face cache" in line
            and "HF_HUB_OFFLINE" in line), line
    line = launched(tmp_path, capsys, "model.teacher=/nonexistent/teacher",
                    "model.random_teacher=null")
    assert line == "error: model.teacher: /nonexistent/teacher does not exist", line


def planted_teacher(tmp_path) -> Path:
    """A teacher folder (HF config and weights of a tiny Qwen3) that also carries a modeling file
    and an auto_map: code we did not write."""
    from conftest import tiny_qwen3

    folder = tmp_path / "teacher"
    tiny_qwen3().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_evil.py").write_text("raise SystemExit('foreign code ran')\n")
    return folder


def test_a_folder_with_foreign_code_is_refused_before_anything_is_built(tmp_path, capsys):
    """Before: stage 2 trained every step and refused the folder only when it wrote its output."""
    teacher = planted_teacher(tmp_path)
    capsys.readouterr()  # transformers' progress bar while saving it
    line = launched(tmp_path, capsys, f"model.teacher={teacher}", "model.random_teacher=null",
                    "model.stage1_weights=null", "data.train=/nonexistent/shards")
    assert (f"model.teacher: {teacher} carries code that halo_dist did not write" in line
            and "modeling_evil.py" in line and "--trust-remote-code" in line), line
    assert not (tmp_path / "run").exists()  # refused before the data check and the run folder


def test_the_model_source_checks_cover_student_init_for_every_stage(tmp_path):
    from halo_dist.models.trust import UntrustedCodeError, check_model_sources

    teacher = planted_teacher(tmp_path)
    for path in (REPO / "configs" / "tiny" / "stage3.yaml", REPO / "configs" / "opd" / "tiny.yaml"):
        cfg = load_config(path, {"model.student_init": str(teacher)})
        with pytest.raises(UntrustedCodeError, match=r"model.student_init: .*modeling_evil.py"):
            check_model_sources(cfg)
        check_model_sources(load_config(path, {"model.student_init": str(teacher),
                                               "model.trust_remote_code": True}))
    assert issubclass(UntrustedCodeError, HaloUserError)


# --- resumes that DeepSpeed would refuse with a traceback ---------------------------------------

def test_an_opd_rung_from_a_snapshot_of_another_student_is_refused_before_loading(tmp_path):
    """Before: a state-dict RuntimeError from DeepSpeed's load (a rung is not compared by
    config)."""
    from conftest import tiny_qwen3
    from opd_configs import VOCAB, tiny_cfg

    from halo_dist.errors import IncompatibleInputError
    from halo_dist.eval.tokenizers import byte_tokenizer
    from halo_dist.opd.trainer import OPDTrainer

    def run(run_dir, *overrides):
        cfg = tiny_cfg(run_dir, "opd.eval_every=0", "checkpoint.every_steps=0",
                       "schedule.warmup_steps=1", "schedule.decay_steps=2", "opd.horizon_start=8",
                       "opd.horizon_max=16", *overrides)
        trainer = OPDTrainer(cfg, hf_teacher=tiny_qwen3(vocab=VOCAB), tokenizer=byte_tokenizer())
        trainer.setup()
        return trainer

    first = run(tmp_path / "a", "schedule.total_steps=4")
    first.train()
    first.finish()
    snapshot = tmp_path / "a" / "snapshots" / "step-00000002"
    with pytest.raises(IncompatibleInputError) as excinfo:
        run(tmp_path / "b", "schedule.total_steps=6", f"opd.resume_from={snapshot}",
            "model.attn_layers=[2]")
    assert (f"{snapshot} holds the weights of another student" in str(excinfo.value)
            and "mixer_types: ['lightning', 'attention', 'lightning', 'lightning'] -> "
                "['lightning', 'lightning', 'attention', 'lightning']" in str(excinfo.value))
    assert run(tmp_path / "c", "schedule.total_steps=6", f"opd.resume_from={snapshot}").step == 2
