"""Model FLOPs per trained token (PaLM App. B): the formulas MFU and the from-scratch plans
share."""

from __future__ import annotations


def flops_per_token(n_trainable: float, n_frozen_forward: float = 0, *, attn_layers: int = 0,
                    frozen_attn_layers: int = 0, attn_dim: int = 0, context: float = 0) -> float:
    """Model FLOPs per trained token: 6 N_student + 2 N_teacher + attention score FLOPs.

    ``n_trainable``: parameters updated (forward + backward, 6 per token); count the lm_head, not
    the input embedding. ``n_frozen_forward``: parameters only run forward (the teacher: 2 per
    token). Attention: ``attention_flops_coefficient(...) * context`` (PaLM App. B), where
    ``context`` is the keys a token attends: the row length for unpacked rows,
    ``attended_context(cu_seqlens)`` for packed documents (RNN layers' state updates are not
    counted).
    """
    coef = attention_flops_coefficient(attn_layers, frozen_attn_layers, attn_dim)
    return 6.0 * n_trainable + 2.0 * n_frozen_forward + coef * context


def attention_flops_coefficient(attn_layers: int = 0, frozen_attn_layers: int = 0,
                                attn_dim: int = 0) -> float:
    """Attention score FLOPs per token per attended key: PaLM's 12 L d for trained softmax-attention
    layers (forward + backward of QK^T and AV), 4 L d for forward-only ones; d = heads x head_dim.
    No causal halving (as in PaLM), so a causal row of T tokens counts T keys per token."""
    return float((12 * attn_layers + 4 * frozen_attn_layers) * attn_dim)


def attention_flop_terms(student_config=None, teacher_config=None) -> dict:
    """The softmax-attention terms of ``attention_flops_coefficient`` for a trained student and a
    forward-only teacher (either may be None): the student's attention layers (stage 1 passes None:
    it trains only RNN layers), every teacher layer, and the attention width from the teacher's
    config (else the student's)."""
    if student_config is None and teacher_config is None:
        return {}
    trained = (sum(m == "attention" for m in student_config.mixer_types)
               if student_config is not None else 0)
    frozen = getattr(teacher_config, "num_hidden_layers", 0) if teacher_config is not None else 0
    ref = teacher_config if teacher_config is not None else student_config
    head_dim = getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads
    return {"attn_layers": trained, "frozen_attn_layers": frozen,
            "attn_dim": ref.num_attention_heads * head_dim}
