"""HALO stages: what each stage trains and what it writes. The loop lives in halo_dist.train.

  stage1  Stage1Aligner   all RNN layers, MSE to the teacher's attention outputs -> rnn_layers.safetensors
  stage2  DistillModule   the hybrid (conversion + stage-1 RNNs + selected attention layers), forward KL
  stage3  DistillModule   the stage-2 student at long context, forward KL (or CE)      -> HF folder
  pretrain DistillModule  a random model (pretrain.py: transformer | swan | hypenet), CE -> HF folder
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import PE_ROPE, ModelConfig, RunConfig, to_dict
from ..config.coerce import fail
from .distill import DistillModule
from .stage1 import STAGE1_FILE, Stage1Aligner, resolve_stage1_file, save_stage1_weights, stage1_state_dict
from .teacher import as_exact_hypenet, load_hf_teacher


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
    """A student loaded from ``model.student_init`` keeps the position encoding its weights were trained
    with, so a ``model.pe`` that names another one would be silently ignored: refuse it before the teacher
    loads. Reads only the folder's config.json (a folder without one fails when it is loaded)."""
    from ..models.hypenet import HypeNetConfig

    config_file = Path(m.student_init or "") / "config.json"
    if m.pe is None or not m.student_init or not config_file.is_file():
        return
    folder = HypeNetConfig.from_json_file(str(config_file))  # absent keys take HypeNetConfig's defaults
    found = (bool(folder.attn_rope), bool(folder.rnn_rope))
    if found != PE_ROPE[m.pe]:
        folder_pe = next(name for name, rope in PE_ROPE.items() if rope == found)  # the table has all four
        fail("model.pe", f"{m.pe} (attn_rope={PE_ROPE[m.pe][0]}, rnn_rope={PE_ROPE[m.pe][1]}) disagrees with "
             f"model.student_init={m.student_init}, whose config.json has attn_rope={found[0]}, "
             f"rnn_rope={found[1]} (pe {folder_pe}): set model.pe=null to keep the folder's encoding")


def _loss_tokens(batch: dict) -> int:
    return int(batch["input_ids"].numel())


def _ce_tokens(batch: dict) -> int:
    return int((batch["labels"] != -100).sum())


def _split_tokens(max_position: int):
    """Loss tokens of ``loss.kl_max_position``: KL tokens before it, CE tokens (with a label) from it on."""
    def count(batch: dict) -> int:
        inside = batch["position_ids"] < max_position
        return int(inside.sum() + ((batch["labels"] != -100) & ~inside).sum())
    return count


def build_stage_module(cfg: RunConfig):
    """Returns ``(trainable module, frozen teacher or None)`` for ``cfg.stage.name``."""
    from ..models.convert import convert_model
    from ..models.hypenet import HypeNetForCausalLM
    from ..models.hypenet.modeling_hypenet import compile_decoder_layers

    name = cfg.stage.name
    if name == "pretrain":
        from .pretrain import build_pretrain_module

        return build_pretrain_module(cfg)
    check_student_init_pe(cfg.model)
    hf_teacher = load_hf_teacher(cfg.model)
    teacher = as_exact_hypenet(hf_teacher)
    if name == "stage1":
        module = Stage1Aligner(hf_teacher, teacher, **student_overrides(cfg))
        module.loss_tokens = _loss_tokens
        module.student_model = lambda: _MixerHolder(module)
        return module, teacher
    if name not in ("stage2", "stage3"):
        raise ValueError(f"stage {name!r} is not a distillation stage (see launchers/)")
    if cfg.model.student_init:
        student = HypeNetForCausalLM.from_pretrained(cfg.model.student_init, dtype=torch.float32)
    else:
        s1 = resolve_stage1_file(cfg.model.stage1_weights) if cfg.model.stage1_weights else None
        if s1 is not None and not s1.exists():
            raise FileNotFoundError(f"model.stage1_weights: {s1} does not exist (run stage 1 first)")
        student = convert_model(hf_teacher, cfg.model.attn_layers, stage1_weights=s1, **student_overrides(cfg))
    del hf_teacher
    _check_vocab(student, teacher)
    if cfg.model.activation_checkpointing:
        student.model.gradient_checkpointing = True
    compile_decoder_layers(student, cfg.model.compile)
    compile_decoder_layers(teacher, cfg.model.compile)
    objective = cfg.loss.objective
    split = cfg.loss.kl_max_position
    module = DistillModule(student, teacher if objective != "ce" else None, objective=objective,
                           temperature=cfg.loss.temperature, ce_weight=cfg.loss.ce_weight, chunk_size=cfg.loss.chunk_size,
                           kl_max_position=split, backend=cfg.loss.backend)
    module.loss_tokens = _ce_tokens if objective == "ce" else (_split_tokens(split) if split else _loss_tokens)
    module.student_model = lambda: module.student
    return module, (teacher if objective != "ce" else None)


def _check_vocab(student, teacher) -> None:
    vs, vt = student.config.vocab_size, teacher.config.vocab_size
    if vs != vt:
        raise ValueError(f"student vocabulary {vs} != teacher vocabulary {vt}: distillation needs one tokenizer")


class _MixerHolder(torch.nn.Module):
    """Lets SP injection walk the stage-1 mixers like a model's layers."""

    def __init__(self, aligner):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(_Layer(m) for m in aligner.mixers)
        self.config = aligner.student_config


class _Layer(torch.nn.Module):
    def __init__(self, mixer):
        super().__init__()
        self.mixer = mixer


def run_record(cfg: RunConfig, step: int, tokens: int, metrics=None, **fields) -> dict:
    """What this run made, for its output's DONE / halo_dist.json and the export's model card: stage, teacher,
    steps, tokens, ``fields``, the held-out figures of its last evaluation (``metrics.last_eval``), and under
    ``history`` the records of what its student started from (oldest first)."""
    record = {"stage": cfg.stage.name, "step": step, "tokens": tokens}
    if cfg.model.teacher:
        record["teacher"] = cfg.model.teacher
    record.update(fields)
    last = getattr(metrics, "last_eval", None)
    if last:
        record["eval"] = dict(last)
    history = lineage(cfg)
    if history:
        record["history"] = history
    return record


def lineage(cfg: RunConfig) -> list[dict]:
    """The records of the models this run's student comes from: a ``student_init`` export's own lineage and
    record; else the conversion from the teacher, then the stage-1 run whose weights stage 2 reads."""
    m = cfg.model
    if m.student_init:
        from ..models.export import read_record

        done = read_record(m.student_init)
        if done is None:
            return [{"stage": "init", "checkpoint": m.student_init}]
        return list(done.pop("history", [])) + [done]
    if cfg.stage.name == "pretrain" or not m.teacher:
        return []
    history = [{"stage": "convert", "teacher": m.teacher, "attn_layers": list(m.attn_layers)}]
    if m.stage1_weights and cfg.stage.name != "stage1":
        try:
            done = json.loads((resolve_stage1_file(m.stage1_weights).parent / "DONE").read_text())
        except (OSError, ValueError):
            done = None
        if isinstance(done, dict):
            done.pop("history", None)  # the same conversion
            history.append(done)
    return history


def export_generation_config(cfg: RunConfig):
    """The generation defaults exported with the student: the initial student's, else the teacher's."""
    from ..models.convert import ConversionError, resolve_teacher, teacher_generation_config
    from ..models.export import load_generation_config
    from .teacher import teacher_path

    if cfg.model.student_init:
        found = load_generation_config(cfg.model.student_init)
        if found is not None and not getattr(found, "_from_model_config", False):
            return found
    if not cfg.model.teacher or cfg.model.teacher == "random":
        return None
    try:
        return teacher_generation_config(resolve_teacher(teacher_path(cfg.model.teacher)))
    except ConversionError:
        return None


def _teacher_tokenizer(cfg: RunConfig):
    """The tokenizer exported with the student: the teacher's (or the initial student's) one."""
    from ..models.trust import UntrustedCodeError, load_tokenizer
    from .teacher import teacher_path

    for source in (cfg.model.student_init, None if cfg.model.teacher == "random" else teacher_path(cfg.model.teacher)):
        if source:
            try:
                return load_tokenizer(source, cfg.model.trust_remote_code)
            except UntrustedCodeError:
                raise
            except (OSError, ValueError, TypeError):
                continue
    return None


def gathered_state_dict(trainer) -> dict[str, torch.Tensor] | None:
    """Full trainable-module state dict on rank 0 (ZeRO-3 shards gathered), None elsewhere."""
    engine = trainer.engine
    if trainer.cfg.parallel.zero_stage == 3:
        state = engine._zero3_consolidated_16bit_state_dict()
    else:
        state = engine.module.state_dict()
    return state if trainer.rank == 0 else None


def write_stage_output(trainer, folder: Path) -> Path | None:
    """stage 1: the RNN-layer file; stages 2/3 and pretrain: an HF HypeNet folder. Rank 0 writes; all ranks call."""
    from ..models.export import write_hf_folder

    if trainer.cfg.stage.name == "pretrain":
        from .pretrain import write_pretrain_output

        return write_pretrain_output(trainer, folder)
    state = gathered_state_dict(trainer)
    if trainer.rank != 0:
        return None
    cfg = trainer.cfg
    module = trainer.module
    record = run_record(cfg, trainer.step, trainer.tokens_seen, trainer.metrics, seq_len=cfg.data.seq_len,
                        **({} if cfg.model.student_init else {"attn_layers": list(cfg.model.attn_layers)}))
    if cfg.stage.name != "stage1":
        return write_hf_folder(state, module.student.config, folder, tokenizer=_teacher_tokenizer(cfg), record=record,
                               generation_config=export_generation_config(cfg), run_config=to_dict(cfg))
    path = save_stage1_weights(stage1_state_dict(state), folder, len(module.mixers), cfg.model.teacher,
                               rnn_rope=module.student_config.rnn_rope)
    (folder / "run_config.json").write_text(json.dumps(to_dict(cfg), indent=2, default=str))
    (folder / "DONE").write_text(json.dumps(record, indent=2, default=str))
    return path


__all__ = ["STAGE1_FILE", "DistillModule", "Stage1Aligner", "build_stage_module", "check_student_init_pe",
           "export_generation_config", "lineage", "run_record", "student_overrides", "write_stage_output"]
