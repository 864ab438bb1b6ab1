"""Model FLOPs per trained token (PaLM App. B): the formulas MFU and the from-scratch plans share."""

from __future__ import annotations


def flops_per_token(n_trainable: float, n_frozen_forward: float = 0, *, attn_layers: int = 0,
                    frozen_attn_layers: int = 0, attn_dim: int = 0, context: float = 0) -> float:
    """Model FLOPs per trained token: 6 N_student + 2 N_teacher + attention score FLOPs.

    ``n_trainable``: parameters updated (forward + backward, 6 per token); count the lm_head, not
    the input embedding. ``n_frozen_forward``: parameters only run forward (the teacher: 2 per
    token). Attention: ``attention_flops_coefficient(...) * context`` (PaLM App. B), where ``context`` is
    the keys a token attends: the row length for unpacked rows, ``attended_context(cu_seqlens)`` for
    packed documents (RNN layers' state updates are not counted).
    """
    coef = attention_flops_coefficient(attn_layers, frozen_attn_layers, attn_dim)
    return 6.0 * n_trainable + 2.0 * n_frozen_forward + coef * context


def attention_flops_coefficient(attn_layers: int = 0, frozen_attn_layers: int = 0, attn_dim: int = 0) -> float:
    """Attention score FLOPs per token per attended key: PaLM's 12 L d for trained softmax-attention layers
    (forward + backward of QK^T and AV), 4 L d for forward-only ones; d = heads x head_dim. No causal halving
    (as in PaLM), so a causal row of T tokens counts T keys per token."""
    return float((12 * attn_layers + 4 * frozen_attn_layers) * attn_dim)
