"""The ``model:`` section: teacher, student initialisation and the HypeNet switches.

Stage ``pretrain`` has no teacher; its variant and shape are the ``pretrain:`` section
(halo_dist/config/pretrain_schema.py). It reads the HypeNet switches here that the distilled
students read too (``pe``, ``rnn_mixer``, ``attn_layers``, logits scaling, output gate/norm,
``dtype``, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from .coerce import fail
from .section import Section, _positive

# HypeNet position encodings (from-scratch models and distilled students).
PositionEncoding = Literal["hype", "all_rope", "all_nope", "attn_rope_rnn_nope"]


@dataclass(kw_only=True, frozen=True)
class RandomTeacherConfig(Section):
    """A randomly initialised teacher (CPU tests, GPU benchmarks of the real shapes).

    Field names are Hugging Face ``Qwen3Config`` / ``LlamaConfig`` names so a builder can pass them
    through. ``architecture`` picks the family: Qwen3 (QK-norm in attention) or Llama (none, as
    SmolLM2), so a benchmark or warm-up runs, and compiles, the same layers as the real teacher.
    """

    architecture: Literal["qwen3", "llama"] = "qwen3"

    num_hidden_layers: int  # transformer blocks
    hidden_size: int  # model width d
    intermediate_size: int  # SwiGLU FFN width
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # KV heads (GQA); must divide num_attention_heads
    head_dim: int  # per-head width d_h
    vocab_size: int
    tie_word_embeddings: bool = True  # Qwen3-1.7B/4B tie, Qwen3-8B does not
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    seed: int = 0  # weight-init seed, so every rank and every test builds the same teacher

    def validate(self) -> None:
        for name in ("num_hidden_layers", "hidden_size", "intermediate_size", "head_dim",
                     "num_attention_heads", "num_key_value_heads", "vocab_size"):
            _positive(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            fail("num_key_value_heads", f"{self.num_key_value_heads} does not divide "
                 f"num_attention_heads={self.num_attention_heads}")


@dataclass(kw_only=True, frozen=True)
class ModelConfig(Section):
    """Teacher, student initialisation and HypeNet hyperparameters."""

    # HF hub id or local folder; "random" uses random_teacher; none for pretrain
    teacher: Optional[str] = None
    random_teacher: Optional[RandomTeacherConfig] = None  # shape of a random teacher
    # run code that a teacher/student folder carries (auto_map, .py); folders halo_dist exported are
    # trusted without it (halo_dist.models.trust)
    trust_remote_code: bool = False
    num_layers: Optional[int] = None  # teacher depth, when known, to range-check attn_layers
    attn_layers: list[int] = field(default_factory=list)  # 0-based layers kept as softmax attention
    student_init: Optional[str] = None  # HypeNet checkpoint/HF folder to start from (stage 3, OPD)
    stage1_weights: Optional[str] = None  # stage-1 output (aligned RNN layers) that stage 2 reads
    rnn_mixer: Literal["lightning", "gdn", "gla", "rwkv7", "mamba2"] = "lightning"
    logits_scaling_a: Optional[float] = None  # a of s_t = log_a(t + a); null disables
    # also scale in training (the public reference code scales at inference only)
    logits_scaling_in_training: bool = True
    attn_output_gate: bool = True  # sigmoid gate on attention output, initialised as identity
    attn_output_norm: bool = False  # appendix RMSNorm on attention output; changes the teacher fn
    dtype: Literal["bfloat16", "float32"] = "bfloat16"  # float32 for CPU tests
    activation_checkpointing: bool = True  # applied in model code (DeepSpeed's json block is inert)
    # torch.compile per decoder layer (student + teacher)
    compile: Literal["none", "mlp", "layer"] = "none"
    # HypeNet position encoding, null = hype: RoPE in the RNN layers, NoPE in the attention layers
    # (HyPE) | all_rope (attention keeps the teacher's RoPE: the HyPE ablation) | all_nope |
    # attn_rope_rnn_nope.
    # Read by stage pretrain (pretrain.arch=hypenet) and by the students converted from the teacher
    # (stages 1, 2, OPD; stage 2 refuses stage-1 weights aligned with another RNN RoPE). An all_rope
    # run normally sets logits_scaling_a null (when set, it still scales the attention logits). A
    # student loaded from student_init (stage 3, OPD) keeps its folder's encoding: pe must then be
    # null or the folder's.
    pe: Optional[PositionEncoding] = None

    def validate(self) -> None:
        if self.teacher is not None and not self.teacher:
            fail("teacher", "must name a hub id, a folder or 'random'")
        if (self.teacher == "random") != (self.random_teacher is not None):
            fail("random_teacher", "set exactly when teacher is 'random'")
        self._validate_attn_layers()
        if self.logits_scaling_a is not None and self.logits_scaling_a <= 1:
            fail("logits_scaling_a", f"must be > 1 (log base), got {self.logits_scaling_a}")

    def _validate_attn_layers(self) -> None:
        if len(set(self.attn_layers)) != len(self.attn_layers):
            fail("attn_layers", f"duplicate layer index in {self.attn_layers}")
        depth = self.depth
        for layer in self.attn_layers:
            if layer < 0 or (depth is not None and layer >= depth):
                fail("attn_layers", f"layer {layer} outside 0..{(depth or 0) - 1}")

    @property
    def depth(self) -> Optional[int]:
        """Teacher layer count if this section knows it (stage pretrain's depth is
        pretrain.model's)."""
        if self.random_teacher is not None:
            return self.random_teacher.num_hidden_layers
        return self.num_layers
