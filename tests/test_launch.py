"""The stage table and the launchers' error handling: a user mistake is one ``error:`` line and exit
2, a bug keeps its traceback; the stage modules' protocol and stage 1's direct SP injection."""

import dataclasses
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
from conftest import tiny_qwen3

from halo_dist.config import ConfigError
from halo_dist.config.schema import StageName
from halo_dist.errors import HaloUserError, MissingInputError
from halo_dist.launch import launch
from halo_dist.parallel import SequenceParallelError, apply_sequence_parallel_to_mixers
from halo_dist.stages import StudentWithLoss, Stage1Aligner, StageModule
from halo_dist.models.convert import as_exact_hypenet
from halo_dist import registry

REPO = Path(__file__).resolve().parents[1]
STAGE2 = ["--config", str(REPO / "configs" / "tiny" / "stage2.yaml")]


class BuildOnly:
    """A trainer that only builds its stage: ``launch``'s handling of what the build raises, without
    a process group or data."""

    def __init__(self, cfg, argv, *, stage):
        self.cfg, self.stage = cfg, stage

    def setup(self):
        self.stage.build(self.cfg)
        raise AssertionError("the build was expected to fail")


def with_row(monkeypatch, name, **changes):
    """Replace fields of stage ``name``'s row of the table for this test."""
    monkeypatch.setitem(registry.STAGES, name,
                        dataclasses.replace(registry.STAGES[name], **changes))


def test_every_configurable_stage_has_a_row_and_an_unknown_one_lists_them(capsys):
    assert set(registry.STAGES) == set(typing.get_args(StageName))
    assert all(name == spec.name for name, spec in registry.STAGES.items())
    with pytest.raises(ConfigError, match="stage.name: unknown stage 'stage9'; known stages: "
                                          "stage1, stage2, stage3"):
        registry.stage_spec("stage9")
    assert launch("stage9", argv=STAGE2) == 2
    err = capsys.readouterr().err
    assert (err.startswith("error: ")
            and "known stages: stage1, stage2, stage3, pretrain, opd" in err)
    assert len(err.strip().splitlines()) == 1


def test_a_user_error_in_the_build_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    with_row(monkeypatch, "stage2", trainer_cls=BuildOnly)  # the real stage-2 build
    assert launch("stage2", argv=[*STAGE2, "model.stage1_weights=/nonexistent/s1",
                                  f"logging.run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert (err == "error: model.stage1_weights: /nonexistent/s1 does not exist (run stage 1 "
                   "first)\n"), err
    assert (issubclass(MissingInputError, FileNotFoundError)
            and issubclass(MissingInputError, HaloUserError))


@pytest.mark.parametrize("bug", [KeyError("layers"), RuntimeError("shape mismatch"),
                                 ValueError("bad tensor")])
def test_a_bug_in_the_build_keeps_its_traceback(monkeypatch, bug, tmp_path):
    """Not a HaloUserError (a bare ValueError included): the exception leaves launch() as it was
    raised."""
    def build(cfg):
        raise bug

    with_row(monkeypatch, "stage2", build=build, trainer_cls=BuildOnly)
    with pytest.raises(type(bug)) as raised:
        launch("stage2", argv=[*STAGE2, f"logging.run_dir={tmp_path}"])
    assert raised.value is bug


@pytest.mark.slow
def test_the_launcher_script_reports_missing_data_without_a_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run([sys.executable, str(REPO / "launchers" / "stage2.py"), *STAGE2,
                          f"logging.run_dir={tmp_path / 'run'}", f"data.train={tmp_path / 'none'}"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(tmp_path / "none") in errors[0], res.stderr[-3000:]


def test_stage_modules_implement_the_protocol_and_stage1_mixers_take_sp_directly():
    hf = tiny_qwen3(heads=6, kv_heads=2)
    teacher = as_exact_hypenet(hf)
    aligner = Stage1Aligner(hf, teacher)
    distill = StudentWithLoss(as_exact_hypenet(hf), teacher)
    assert isinstance(aligner, StageModule) and isinstance(distill, StageModule)
    mixers = aligner.sp_mixers()
    assert mixers == list(aligner.mixers) and len(mixers) == hf.config.num_hidden_layers
    assert aligner.student_config.num_hidden_layers == hf.config.num_hidden_layers
    assert distill.sp_mixers() == [layer.mixer for layer in distill.student.model.layers]
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}
    assert aligner.loss_tokens(batch) == distill.loss_tokens(batch) == 16

    class SP4:  # size 4 does not divide 6 heads: refused before any mixer changes, no communication
        world_size, rank, group = 4, 0, None

    with pytest.raises(SequenceParallelError,
                       match=r"layer 0 \(LightningMixer\): sp_size=4 does not divide its 6"):
        apply_sequence_parallel_to_mixers(mixers, SP4())
    assert all(m.sp is None for m in mixers)
    sp2 = type("SP2", (SP4,), {"world_size": 2})()
    apply_sequence_parallel_to_mixers(mixers, sp2)
    assert all(m.sp is sp2 for m in mixers)


def test_config_and_data_errors_share_the_user_error_base():
    from halo_dist.data import DataError
    from halo_dist.models.convert import ConversionError
    from halo_dist.train.checkpoint import CheckpointWriteError
    from halo_dist.train.stopping import NonFiniteLossError

    for cls in (ConfigError, DataError, ConversionError, CheckpointWriteError, NonFiniteLossError):
        assert issubclass(cls, HaloUserError), cls
    assert issubclass(ConfigError, ValueError) and issubclass(NonFiniteLossError, RuntimeError)
