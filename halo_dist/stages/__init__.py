"""HALO stages: what each stage trains and what it writes. The loop lives in halo_dist.train, the
table of stages (build, output, trainer) in halo_dist.registry; stages never import train.

  stage1    Stage1Aligner    all RNN layers, MSE to the teacher's attention outputs
                             -> rnn_layers.safetensors
  stage2    StudentWithLoss  the hybrid (conversion + stage-1 RNNs + selected attention layers),
                             forward KL
  stage3    StudentWithLoss  the stage-2 student at long context, forward KL (or CE) -> HF folder
  pretrain  StudentWithLoss  a random model (pretrain.py: transformer | swan | hypenet), CE
                             -> HF folder
  opd       OPDModule        on-policy distillation (opd/: its trainer builds and writes it)
                             -> HF folder

protocol.py: what the trainer calls on a stage module (StageModule) and a stage's row (StageSpec);
build.py: the distillation stages' modules; output.py: their outputs and run records.
"""

from __future__ import annotations

from .build import (build_distill_module, build_stage1_module, check_student_init_pe,
                    student_overrides)
from .distill import StudentWithLoss
from .output import (check_stage_output, export_generation_config, gathered_state_dict, lineage,
                     run_record, stage_inputs, teacher_tokenizer, write_distill_output,
                     write_stage1_output)
from .protocol import StageModule, StageSpec
from .stage1 import STAGE1_FILE, Stage1Aligner

__all__ = ["STAGE1_FILE", "StudentWithLoss", "Stage1Aligner", "StageModule", "StageSpec",
           "build_distill_module", "build_stage1_module", "check_stage_output",
           "check_student_init_pe", "export_generation_config", "gathered_state_dict", "lineage",
           "run_record", "stage_inputs", "student_overrides", "teacher_tokenizer",
           "write_distill_output", "write_stage1_output"]
