"""A checkpoint is loaded only into the student it was written from.

Every checkpoint records its student's config (``student_config`` in trainer_state.json). The
resume check compares run configs, but an OPD rung (``opd.resume_from``: a snapshot of *another*
run) is not compared, and a ``student_init`` folder may have changed under the same path. Loading
a checkpoint into a student of another shape fails deep inside DeepSpeed with a state-dict
traceback; one with the same parameter shapes but another layout (attention and RNN layers
swapped where their shapes agree) would load silently. So before loading, the built student's
config is compared with the recorded one, setting by setting.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import IncompatibleInputError

# Settings that do not change the weights or the function a checkpoint holds: bookkeeping of every
# Hugging Face config (transformers.PretrainedConfig's own keys, less model_type), what the student
# was converted from, the init scale, the recorded context and the special token ids.
NOT_ARCHITECTURE = frozenset({
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype",
    "id2label", "is_encoder_decoder", "label2id", "output_attentions", "output_hidden_states",
    "problem_type", "return_dict", "transformers_version", "teacher_name_or_path",
    "initializer_range", "max_position_embeddings", "pad_token_id", "bos_token_id",
    "eos_token_id", "use_cache", "auto_map"})


def architecture_differences(saved: dict, built: dict) -> list[str]:
    """``key: saved -> built`` for every architecture setting both configs have and that differs."""
    keys = sorted((set(saved) & set(built)) - NOT_ARCHITECTURE)
    return [f"{key}: {saved[key]!r} -> {built[key]!r}" for key in keys if saved[key] != built[key]]


def check_same_student(checkpoint: Path, student_config) -> None:
    """Refuse to load ``checkpoint`` into a student whose architecture differs from the one it
    recorded (module doc); checkpoints that recorded none are not checked."""
    from .checkpoint import TRAINER_STATE

    saved = json.loads((checkpoint / TRAINER_STATE).read_text()).get("student_config")
    if not saved:
        return
    built = json.loads(json.dumps(student_config.to_dict(), default=str))  # as it was recorded
    differences = architecture_differences(saved, built)
    if differences:
        raise IncompatibleInputError(
            f"{checkpoint} holds the weights of another student than this run builds "
            f"(checkpoint -> this run): {'; '.join(differences)}. Use the model settings "
            "(model.attn_layers, the teacher or model.student_init) of the run that wrote it")
