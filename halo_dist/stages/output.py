"""What the stages write: the run record, the stage-1 RNN-layer file, the distilled student's HF
folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import RunConfig, to_dict
from .stage1 import resolve_stage1_file, save_stage1_weights, stage1_state_dict


def run_record(cfg: RunConfig, step: int, tokens: int, metrics=None, **fields) -> dict:
    """What this run made, for its output's DONE / halo_dist.json and the export's model card:
    stage, teacher, steps, tokens, ``fields``, the held-out figures of its last evaluation
    (``metrics.last_eval``), and under ``history`` the records of what its student started from
    (oldest first)."""
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
    """The records of the models this run's student comes from: a ``student_init`` export's own
    lineage and record; else the conversion from the teacher, then the stage-1 run whose weights
    stage 2 reads."""
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
    """The generation defaults exported with the student: the initial student's, else the
    teacher's."""
    from ..models.convert import ConversionError, resolve_teacher, teacher_generation_config
    from ..models.export import load_generation_config
    from ..teacher import teacher_path

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


def teacher_tokenizer(cfg: RunConfig):
    """The tokenizer exported with the student: the teacher's (or the initial student's) one."""
    from ..models.trust import UntrustedCodeError, load_tokenizer
    from ..teacher import teacher_path

    for source in (cfg.model.student_init,
                   None if cfg.model.teacher == "random" else teacher_path(cfg.model.teacher)):
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


def _record(trainer) -> dict:
    cfg = trainer.cfg
    # stage 1 trains an RNN for every layer: its config's attention layers are no choice of it
    keeps = not cfg.model.student_init and cfg.stage.name != "stage1"
    return run_record(cfg, trainer.step, trainer.tokens_seen, trainer.metrics,
                      seq_len=cfg.data.seq_len,
                      **({"attn_layers": sorted(cfg.model.attn_layers)} if keeps else {}))


def stage_inputs(cfg: RunConfig) -> dict:
    """What a stage reads that its ``final/`` may not be, hold or lie inside (the teacher's folder,
    the initial student, the stage-1 weights), by the config key that names it."""
    from ..teacher import teacher_path

    m = cfg.model
    teacher = None if m.teacher in (None, "random") else teacher_path(m.teacher)
    return {"model.teacher": teacher, "model.student_init": m.student_init,
            "model.stage1_weights": m.stage1_weights}


def check_stage_output(cfg: RunConfig) -> Path:
    """Before anything is built: the stage can write ``<run_dir>/final`` when it ends (empty,
    absent, or an earlier output of ours, which it replaces; apart from the inputs), or refuses
    now. Returns the folder."""
    from ..outputs import check_output

    return check_output(Path(cfg.logging.run_dir) / "final", stage_inputs(cfg), overwrite=True)


def write_distill_output(trainer, folder: Path) -> Path | None:
    """Stages 2/3: the student as an HF HypeNet folder. Rank 0 writes; all ranks call."""
    from ..models.export import write_hf_folder

    state = gathered_state_dict(trainer)
    if trainer.rank != 0:
        return None
    cfg = trainer.cfg
    return write_hf_folder(state, trainer.module.student.config, folder,
                           tokenizer=teacher_tokenizer(cfg), record=_record(trainer),
                           generation_config=export_generation_config(cfg), run_config=to_dict(cfg),
                           overwrite=True, inputs=stage_inputs(cfg))


def write_stage1_output(trainer, folder: Path) -> Path | None:
    """Stage 1: the RNN-layer file (+ run_config.json and DONE). Rank 0 writes; all ranks call."""
    state = gathered_state_dict(trainer)
    if trainer.rank != 0:
        return None
    cfg, module = trainer.cfg, trainer.module
    files = {"run_config.json": json.dumps(to_dict(cfg), indent=2, default=str),
             "DONE": json.dumps(_record(trainer), indent=2, default=str)}
    return save_stage1_weights(stage1_state_dict(state), folder, len(module.mixers),
                               cfg.model.teacher, rnn_rope=module.student_config.rnn_rope,
                               files=files, overwrite=True, inputs=stage_inputs(cfg))
