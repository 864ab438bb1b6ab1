"""The table of stages: every dispatch on ``stage.name`` (what to build, what to write, which
trainer runs it) goes through :func:`stage_spec`. The launchers look the stage up here and hand its
row to :func:`halo_dist.train.entry.run_stage`. It sits above the packages whose trainers it names
(``halo_dist.train``, ``halo_dist.opd``), so none of them imports it: the Trainer never sees this
table."""

from __future__ import annotations

from .config.coerce import ConfigError
from .opd.trainer import OPDTrainer
from .stages import (build_distill_module, build_stage1_module, write_distill_output,
                     write_stage1_output)
from .stages.pretrain import build_pretrain_module, write_pretrain_output
from .stages.protocol import StageSpec
from .train.pretrain_trainer import PretrainTrainer
from .train.trainer import Trainer

STAGES: dict[str, StageSpec] = {spec.name: spec for spec in (
    StageSpec("stage1", build_stage1_module, write_stage1_output, Trainer),
    StageSpec("stage2", build_distill_module, write_distill_output, Trainer),
    StageSpec("stage3", build_distill_module, write_distill_output, Trainer),
    StageSpec("pretrain", build_pretrain_module, write_pretrain_output, PretrainTrainer),
    StageSpec("opd", None, None, OPDTrainer),  # OPDTrainer builds in setup() and writes in finish()
)}


def stage_spec(name: str) -> StageSpec:
    """The row of stage ``name``; an unknown name is a config error listing the known ones."""
    try:
        return STAGES[name]
    except KeyError:
        raise ConfigError([("stage.name", f"unknown stage {name!r}; known stages: "
                                          f"{', '.join(STAGES)}")]) from None
