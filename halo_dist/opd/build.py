"""The models of an on-policy distillation run: the student (converted from the teacher or loaded
from ``model.student_init``), the frozen teacher and the tokenizer they share, checked against each
other."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config.coerce import ConfigError
from ..config.schema import RunConfig
from .stage import check_tokenizers, check_vocab


def load_tokenizer(cfg: RunConfig):
    """``opd.tokenizer`` ("bytes" or a folder / hub id), else the teacher's (``smollm2``: the
    bundled teacher's folder, as the teacher itself is loaded); random teachers need one."""
    from ..teacher import teacher_path

    name = cfg.opd.tokenizer
    if name == "bytes":
        from ..eval.tokenizers import byte_tokenizer

        return byte_tokenizer()
    if name is None and cfg.model.teacher == "random":
        raise ConfigError("a random teacher has no tokenizer: set opd.tokenizer (e.g. 'bytes' for "
                          "tiny tests)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name or teacher_path(cfg.model.teacher))


def student_tokenizer(cfg: RunConfig):
    """The tokenizer saved with ``model.student_init`` (HF folder), if any."""
    init = cfg.model.student_init
    if not init or not Path(init).is_dir() or not any(Path(init).glob("tokenizer*")):
        return None
    from ..models.trust import load_tokenizer

    return load_tokenizer(init, cfg.model.trust_remote_code)


def build_models(cfg: RunConfig, hf_teacher=None, student=None, tokenizer=None):
    """``(student HypeNet, frozen exact teacher, tokenizer)`` with vocabulary/tokenizer checks."""
    from ..models.convert import as_exact_hypenet, convert_model
    from ..models.hypenet import HypeNetForCausalLM
    from ..stages.build import check_student_init_pe, student_overrides
    from ..stages.stage1 import resolve_stage1_file
    from ..teacher import load_hf_teacher

    if student is None:
        check_student_init_pe(cfg.model)
    tokenizer = tokenizer or load_tokenizer(cfg)
    hf_teacher = hf_teacher if hf_teacher is not None else load_hf_teacher(cfg.model)
    teacher = as_exact_hypenet(hf_teacher)
    if student is None:
        if cfg.model.student_init:
            check_tokenizers(tokenizer, student_tokenizer(cfg))
            student = HypeNetForCausalLM.from_pretrained(cfg.model.student_init,
                                                         dtype=torch.float32)
        else:
            s1 = resolve_stage1_file(cfg.model.stage1_weights) if cfg.model.stage1_weights else None
            student = convert_model(hf_teacher, cfg.model.attn_layers, stage1_weights=s1,
                                    **student_overrides(cfg))
    check_vocab(student, teacher, tokenizer)
    return student, teacher, tokenizer
