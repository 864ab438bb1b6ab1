"""Building the distillation stages' modules: stage 1's aligner, stages 2/3's student + loss."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import PE_ROPE, ModelConfig, RunConfig
from ..config.coerce import fail
from ..errors import IncompatibleInputError, MissingInputError
from .distill import StudentWithLoss
from .stage1 import Stage1Aligner, resolve_stage1_file
from ..models.convert import as_exact_hypenet
from ..teacher import load_hf_teacher


def student_overrides(cfg: RunConfig) -> dict:
    """HypeNet switches taken from the run config's model section."""
    m = cfg.model
    attn_rope, rnn_rope = PE_ROPE[m.pe or "hype"]
    return dict(
        attn_rope=attn_rope,
        rnn_rope=rnn_rope,
        attn_logits_scale_base=m.logits_scaling_a if m.logits_scaling_in_training else None,
        attn_output_gate=m.attn_output_gate,
        attn_output_norm=m.attn_output_norm,
    )


def check_student_init_pe(m: ModelConfig) -> None:
    """A student loaded from ``model.student_init`` keeps the position encoding its weights were
    trained with, so a ``model.pe`` that names another one would be silently ignored: refuse it
    before the teacher loads. Reads only the folder's config.json (a folder without one fails when
    it is loaded)."""
    from ..models.hypenet import HypeNetConfig

    config_file = Path(m.student_init or "") / "config.json"
    if m.pe is None or not m.student_init or not config_file.is_file():
        return
    # absent keys take HypeNetConfig's defaults
    folder = HypeNetConfig.from_json_file(str(config_file))
    found = (bool(folder.attn_rope), bool(folder.rnn_rope))
    if found != PE_ROPE[m.pe]:
        # the table has all four
        folder_pe = next(name for name, rope in PE_ROPE.items() if rope == found)
        fail("model.pe",
             f"{m.pe} (attn_rope={PE_ROPE[m.pe][0]}, rnn_rope={PE_ROPE[m.pe][1]}) disagrees with "
             f"model.student_init={m.student_init}, whose config.json has attn_rope={found[0]}, "
             f"rnn_rope={found[1]} (pe {folder_pe}): set model.pe=null to keep the folder's "
             "encoding")


def build_stage1_module(cfg: RunConfig) -> tuple[Stage1Aligner, torch.nn.Module]:
    """``(Stage1Aligner, frozen teacher)``: every layer's RNN mixer, aligned to the teacher's
    attention."""
    check_student_init_pe(cfg.model)
    hf_teacher = load_hf_teacher(cfg.model)
    teacher = as_exact_hypenet(hf_teacher)
    return Stage1Aligner(hf_teacher, teacher, **student_overrides(cfg)), teacher


def build_distill_module(cfg: RunConfig) -> tuple[StudentWithLoss, torch.nn.Module | None]:
    """``(StudentWithLoss, frozen teacher or None for the CE objective)`` of stages 2 and 3: the
    student from ``model.student_init``, else converted from the teacher with the stage-1 RNN
    layers."""
    from ..models.convert import convert_model
    from ..models.hypenet import HypeNetForCausalLM
    from ..models.hypenet.modeling_hypenet import compile_decoder_layers

    check_student_init_pe(cfg.model)
    hf_teacher = load_hf_teacher(cfg.model)
    teacher = as_exact_hypenet(hf_teacher)
    if cfg.model.student_init:
        student = HypeNetForCausalLM.from_pretrained(cfg.model.student_init, dtype=torch.float32)
    else:
        s1 = resolve_stage1_file(cfg.model.stage1_weights) if cfg.model.stage1_weights else None
        if s1 is not None and not s1.exists():
            raise MissingInputError(f"model.stage1_weights: {s1} does not exist (run stage 1 "
                                    "first)")
        student = convert_model(hf_teacher, cfg.model.attn_layers, stage1_weights=s1,
                                **student_overrides(cfg))
    del hf_teacher
    check_same_vocab(student, teacher)
    if cfg.model.activation_checkpointing:
        student.model.gradient_checkpointing = True
    compile_decoder_layers(student, cfg.model.compile)
    compile_decoder_layers(teacher, cfg.model.compile)
    objective = cfg.loss.objective
    kept = teacher if objective != "ce" else None
    module = StudentWithLoss(student, kept, objective=objective, temperature=cfg.loss.temperature,
                           ce_weight=cfg.loss.ce_weight, chunk_size=cfg.loss.chunk_size,
                           kl_max_position=cfg.loss.kl_max_position, backend=cfg.loss.backend)
    return module, kept


def check_same_vocab(student, teacher) -> None:
    """Distillation compares the two models token by token: one vocabulary."""
    vs, vt = student.config.vocab_size, teacher.config.vocab_size
    if vs != vt:
        raise IncompatibleInputError(f"student vocabulary {vs} != teacher vocabulary {vt}: "
                                     "distillation needs one tokenizer")
