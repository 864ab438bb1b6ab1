"""Adapters that make Liger-Kernel's fused distillation losses return what our torch path returns.

Liger conventions (read from liger-kernel 0.8.5's source; see ``docs`` in ``kl.py``):

* Both Liger classes return a **mean**: the per-token sum divided by the number of rows whose label
  is not ``ignore_index`` (all rows when no labels are given to the Triton op), and scale their
  gradients by the same 1/n. We pass only valid rows, so n = rows, and multiply back by n.
* ``beta`` = 0 is forward KL(teacher || student), ``beta`` = 1 reverse KL(student || teacher), in
  between beta KL(teacher || m) + (1 - beta) KL(student || m), m = beta teacher + (1 - beta)
  student: our ``beta`` (student log-probs are the kernel's X / "input", teacher's its Y /
  "target").
* Temperature divides both logits; no T^2 factor; the CE ("hard") term of the chunked class uses
  the raw (T = 1) logits. Same as ours.
* One label tensor masks both KL and CE there, so KL and CE are separate calls here.
"""

from __future__ import annotations

import torch


def liger_available() -> bool:
    """True when liger-kernel's fused distillation losses can be imported."""
    try:
        import liger_kernel.chunked_loss.jsd_loss  # noqa: F401
    except Exception:  # ImportError, or triton failing to initialise
        return False
    return True


def liger_cuda(s_h, s_w, t_h, t_w, labels, cfg, normalizer):
    """Triton path (CUDA): ``liger_kernel.ops.LigerFusedLinearJSDFunction`` + fused linear CE.

    Its logits are fp32 (``mm(..., out_dtype=fp32)``) and with ``accum_dtype=fp32`` the lm_head
    gradient is accumulated in fp32 (the default, None, accumulates in the weight's dtype). Its
    chunk size is chosen by Liger (ceil(V / Ds) chunks on Hopper); ``cfg.chunk_size`` is unused.
    Returns (loss, kl_sum, ce_sum) like ``FusedDistillFunction``.
    """
    from liger_kernel.ops.fused_linear_jsd import LigerFusedLinearJSDFunction
    from liger_kernel.transformers.fused_linear_cross_entropy import (
        LigerFusedLinearCrossEntropyLoss)

    n = s_h.shape[0]
    loss = kl_sum = ce_sum = torch.zeros((), dtype=torch.float32, device=s_h.device)
    if cfg.kl_weight:
        kl_mean = LigerFusedLinearJSDFunction.apply(
            s_h, s_w, t_h, t_w, None, cfg.beta, cfg.ignore_index, cfg.temperature,
            torch.float32, None, None)
        kl_sum = kl_mean.float() * n  # Liger divides by n rows: undo it (grads scale along)
        loss = loss + cfg.kl_weight * kl_sum
    if cfg.ce_weight and labels is not None:
        ce = LigerFusedLinearCrossEntropyLoss(
            ignore_index=cfg.ignore_index, reduction="sum", accum_dtype=torch.float32)
        ce_sum = ce(s_w, s_h, labels).float()
        loss = loss + cfg.ce_weight * ce_sum
    return loss / normalizer, kl_sum.detach(), ce_sum.detach()


def liger_chunked(s_h, s_w, t_h, t_w, labels, cfg, normalizer):
    """Pure-torch path (any device): ``liger_kernel.chunked_loss`` JSD class with compiled=False.

    Used on CPU to cross-check our implementation. Caveats of that class: log-softmax runs in the
    *input* dtype (bf16 under bf16 training: measured 2-80% loss error on a small KL) and the
    lm_head gradient accumulates in the weight's dtype, so half-precision inputs are upcast to fp32
    here (autograd casts the gradients back) and on GPU we use the Triton op instead. KL and CE need
    two calls because one label tensor masks both terms there; with ``weight_soft_loss=0`` the
    second call still computes (and discards) the KL, which is fine for a test path. Returns (loss,
    kl_sum, ce_sum).
    """
    from liger_kernel.chunked_loss.jsd_loss import LigerFusedLinearJSDFunction

    def call(target, w_hard, w_soft):
        # positional: ..., true_labels, student_bias, teacher_bias, weight_hard_loss,
        # weight_soft_loss, beta, ignore_index, temperature, compiled, chunk_size, return_soft_hard
        return LigerFusedLinearJSDFunction.apply(
            s_h, s_w, t_h, t_w, target, None, None, w_hard, w_soft, cfg.beta,
            cfg.ignore_index, cfg.temperature, False, cfg.chunk_size, True)

    if t_h is None:
        raise ValueError("backend='liger' on CPU needs teacher inputs (its only class is the JSD "
                         "one)")
    up = lambda x: x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # noqa: E731
    s_h, s_w, t_h, t_w = up(s_h), up(s_w), up(t_h), up(t_w)
    n = s_h.shape[0]
    loss = kl_sum = ce_sum = torch.zeros((), dtype=torch.float32, device=s_h.device)
    if cfg.kl_weight:
        all_valid = torch.zeros(n, dtype=torch.long, device=s_h.device)
        total, soft, _ = call(all_valid, 0.0, 1.0)
        kl_sum = soft.detach() * n
        loss = loss + cfg.kl_weight * n * total
    if cfg.ce_weight and labels is not None:
        n_ce = (labels != cfg.ignore_index).sum().clamp_min(1)  # Liger's own divisor
        total, _, hard = call(labels, 1.0, 0.0)
        ce_sum = hard.detach() * n_ce
        loss = loss + cfg.ce_weight * n_ce * total
    return loss / normalizer, kl_sum, ce_sum
