"""Pure-torch fused linear + KL/CE loss, chunked over tokens (the CPU path and the CUDA fallback).

The student's gradient is computed *during the forward pass*, chunk by chunk (the trick of Liger's
fused linear losses): each chunk's [c, V] logits, probabilities and logit-gradients are freed
before the next chunk starts, so nothing vocabulary-sized outlives a chunk. What survives to the
backward pass is only the gradient w.r.t. the student hidden states [N, Ds] and the student
lm_head [V, Ds]; backward just multiplies them by the incoming scalar gradient.

Precision: logits come out of the matmul in fp32 (on CUDA via ``torch.mm(..., out_dtype=fp32)``,
which keeps bf16 tensor cores but does not round the logits to bf16; elsewhere by upcasting the
operands), every softmax / KL / CE term is fp32 (fp64 for fp64 inputs), and the lm_head gradient is
accumulated over chunks in fp32 and rounded to the weight's dtype once, at the end of the forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from halo_dist.losses._triton_kl import chunk_grad_triton

# Bytes of transient fp32 [c, V] buffers per (token row x vocab entry) in one chunk: raw student
# logits, teacher logits, student probabilities, teacher probabilities / softmax temporaries, the
# CE-gradient buffer and the low-precision copy of the logit gradient. Used to size chunks.
BYTES_PER_ROW_ENTRY = 28


@dataclass(frozen=True)
class ChunkConfig:
    """Static settings of one fused loss call (already validated by ``kl.py``)."""

    beta: float  # 0: KL(teacher || student); 1: KL(student || teacher); between: generalized JSD
    temperature: float
    kl_weight: float
    ce_weight: float
    ignore_index: int
    chunk_size: int
    # how a chunk's KL/CE and gradient are computed from its logits: "eager" (the in-place torch
    # functions below), "compiled" (``_fused_chunk_grad`` through torch.compile) or "triton"
    # (``_triton_kl.chunk_grad_triton``: two passes over the logits)
    kernel: str = "eager"


def auto_chunk_size(vocab_size: int, memory_budget_bytes: int = 2 << 30,
                    multiple: int = 128) -> int:
    """Token rows per chunk so the chunk's vocabulary-sized buffers fit ``memory_budget_bytes``.

    Args:
        vocab_size: V.
        memory_budget_bytes: transient memory allowed for one chunk (bytes).
        multiple: round down to a multiple of this (matmul-friendly) when the budget allows.
    Returns:
        rows per chunk, >= 1. E.g. V = 151,936 and 2 GiB -> 384 rows.
    """
    rows = max(1, memory_budget_bytes // (BYTES_PER_ROW_ENTRY * vocab_size))
    return rows - rows % multiple if rows >= multiple else rows


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with an fp32 (or wider) result that was never rounded to a low-precision dtype.

    bf16 x bf16 products are exact in fp32 and cuBLAS accumulates in fp32 anyway, so asking it for
    an fp32 output costs nothing but keeps the bits that a cast after a bf16 matmul would lose
    (KL is a difference of nearly equal distributions: that rounding hurts). CPU has no
    ``mm.dtype`` kernel, so there the operands are upcast instead (same numbers, CPU is test-only).
    """
    if a.dtype in (torch.bfloat16, torch.float16):
        if a.is_cuda:
            try:
                return torch.mm(a, b, out_dtype=torch.float32)
            except (RuntimeError, TypeError):  # old torch / old GPU: upcast operands instead
                pass
        return a.float() @ b.float()
    return a @ b


def _addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32 (or fp64) and no [V, Ds]-sized temporary on CUDA."""
    if a.dtype in (torch.bfloat16, torch.float16):
        if a.is_cuda:
            try:
                torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
                return
            except (RuntimeError, TypeError):
                pass
        a, b = a.to(acc.dtype), b.to(acc.dtype)
    acc.addmm_(a, b)


def _log_softmax_(x: torch.Tensor) -> torch.Tensor:
    """In-place log-softmax over the last dim (saves one [c, V] buffer vs F.log_softmax)."""
    return x.sub_(torch.logsumexp(x, dim=-1, keepdim=True))


def _forward_kl_(logq: torch.Tensor, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL(p || q) and its gradient w.r.t. the (temperature-scaled) student logits.

    Args:
        logq: [c, V] student log-probs, fp32. Consumed (overwritten).
        logp: [c, V] teacher log-probs, fp32. Consumed (overwritten).
    Returns:
        kl: [c] nats; grad: [c, V] = q - p (d KL / d student logits).
    """
    p = logp.exp()
    kl = logp.sub_(logq).mul_(p).sum(dim=-1)  # sum_v p (log p - log q)
    return kl, logq.exp_().sub_(p)


def _fused_chunk_grad(z: torch.Tensor, tz: torch.Tensor | None, labels: torch.Tensor | None,
                      kl_factor: torch.Tensor, ce_factor: torch.Tensor,
                      inv_t: float, ignore_index: int, beta: float,
                      out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's per-row divergence (forward KL, reverse KL or generalized JSD, by ``beta``) and
    CE and the weighted gradient w.r.t. the raw student logits, out of place so that torch.compile
    fuses it (backend "compiled").

    Eager, the same math (``_ce_`` + ``_log_softmax_`` + ``_divergence_``, then the weighting and
    the cast for the matmuls) makes some twenty passes over the [c, V] fp32 chunk; compiled, it is
    the row log-sum-exps, one reduction per divergence term and one pointwise pass that writes the
    gradient once, already scaled and in the matmul dtype. The formulas are ``_forward_kl_``,
    ``_reverse_kl_`` and ``_jsd_``'s (their docstrings derive the gradients).

    Args:
        z: [c, V] raw student logits; tz: [c, V] raw teacher logits or None (no KL term).
        labels: [c] int64 targets or None (no CE term); ``ignore_index`` rows get no CE.
        kl_factor, ce_factor: 0-dim tensors, each term's weight / normalizer (tensors, so that a new
            normalizer every step does not recompile); the KL's also carries the 1 / T of the chain
            rule.
        inv_t: 1 / temperature of the KL's softmaxes (CE is always at temperature 1).
        beta: 0 forward KL, 1 reverse KL, between: the generalized JSD (a constant of the graph).
    Returns:
        kl [c], ce [c] (zeros for an absent term) and grad [c, V] in ``out_dtype``.
    """
    kl = ce = z.new_zeros(z.shape[0])
    grad = None
    if labels is not None:
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        valid = labels != ignore_index
        safe = torch.where(valid, labels, 0).unsqueeze(-1)  # [c, 1]
        ce = (lse - z.gather(-1, safe)).squeeze(-1) * valid
        # [c, V], never materialised when fused
        one_hot = torch.arange(z.shape[-1], device=z.device) == safe
        grad = ((z - lse).exp() - one_hot.to(z.dtype)) * (valid.unsqueeze(-1) * ce_factor)
    if tz is not None:
        zs, ts = z * inv_t, tz * inv_t
        logq = zs - torch.logsumexp(zs, dim=-1, keepdim=True)  # [c, V] student log-probs
        logp = ts - torch.logsumexp(ts, dim=-1, keepdim=True)  # [c, V] teacher log-probs
        q = logq.exp()
        if beta == 0.0:  # KL(p || q); d/dz = q - p
            p = logp.exp()
            kl = (p * (logp - logq)).sum(dim=-1)
            g_kl = q - p
        elif beta == 1.0:  # KL(q || p); d/dz = q (log q - log p - KL)
            kl = (q * (logq - logp)).sum(dim=-1)
            g_kl = q * (logq - logp - kl.unsqueeze(-1))
        else:  # beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q
            logm = torch.logaddexp(logq + math.log1p(-beta), logp + math.log(beta))
            kl_pm = (logp.exp() * (logp - logm)).sum(dim=-1)
            kl_qm = (q * (logq - logm)).sum(dim=-1)
            kl = beta * kl_pm + (1.0 - beta) * kl_qm
            g_kl = (1.0 - beta) * q * (logq - logm - kl_qm.unsqueeze(-1))
        g_kl = g_kl * kl_factor
        grad = g_kl if grad is None else grad + g_kl
    return kl, ce, None if grad is None else grad.to(out_dtype)


_COMPILED: dict[str, object] = {}


def compiled_chunk_grad(*args):
    """``_fused_chunk_grad`` compiled once per process; dynamic rows, since the last chunk is
    shorter."""
    fn = _COMPILED.get("chunk_grad")
    if fn is None:
        fn = _COMPILED["chunk_grad"] = torch.compile(_fused_chunk_grad, dynamic=True)
    return fn(*args)


def _reverse_kl_(logq: torch.Tensor, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL(q || p) and its gradient w.r.t. the (temperature-scaled) student logits.

    d/dz_j sum_v q_v (log q_v - log p_v) = q_j (log q_j - log p_j - KL). Same args as _forward_kl_.
    """
    q = logq.exp()
    diff = logq.sub_(logp)  # log q - log p
    kl = torch.linalg.vecdot(q, diff)
    return kl, diff.sub_(kl.unsqueeze(-1)).mul_(q)


def _jsd_(logq: torch.Tensor, logp: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row generalized JSD and its gradient w.r.t. the (temperature-scaled) student logits.

    JSD_beta = beta KL(p || m) + (1 - beta) KL(q || m) with the mixture m = beta p + (1 - beta) q,
    for 0 < beta < 1 (TRL's GKD and Liger's JSD). With q free, d JSD / d q_v = (1 - beta)
    (log q_v - log m_v) (the p / m terms cancel because beta p + (1 - beta) q = m), so through the
    softmax d/dz_j = (1 - beta) q_j (log q_j - log m_j - KL(q || m)). log m is a log-sum-exp of the
    two log-probabilities, finite wherever either is. Same args as _forward_kl_.
    """
    logm = torch.logaddexp(logq + math.log1p(-beta), logp + math.log(beta))
    kl_pm = torch.linalg.vecdot(logp.exp(), logp.sub_(logm))  # logp consumed
    q = logq.exp()
    diff = logq.sub_(logm)  # log q - log m
    del logm
    kl_qm = torch.linalg.vecdot(q, diff)
    grad = diff.sub_(kl_qm.unsqueeze(-1)).mul_(q).mul_(1.0 - beta)
    return kl_pm.mul_(beta).add_(kl_qm, alpha=1.0 - beta), grad


def _divergence_(logq: torch.Tensor, logp: torch.Tensor,
                 beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The endpoints are the plain KLs (as in TRL and Liger), not the limits of the JSD (which
    vanish)."""
    if beta == 0.0:
        return _forward_kl_(logq, logp)
    if beta == 1.0:
        return _reverse_kl_(logq, logp)
    return _jsd_(logq, logp, beta)


def _ce_(z: torch.Tensor, labels: torch.Tensor,
         ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy of raw student logits and its gradient (softmax - one_hot).

    Args:
        z: [c, V] raw (temperature 1) student logits, fp32; not modified.
        labels: [c] int64 targets; rows equal to ``ignore_index`` get zero loss and gradient.
    Returns:
        ce: [c] nats; grad: [c, V].
    """
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0).unsqueeze(-1)
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    ce = (lse - z.gather(-1, safe)).squeeze(-1) * valid
    grad = (z - lse).exp_()
    grad.scatter_add_(-1, safe, torch.full_like(lse, -1.0))
    return ce, grad.mul_(valid.unsqueeze(-1))


def _chunk(s_h, s_w, t_h, t_w, labels, cfg: ChunkConfig, scale):
    """Loss sums of one chunk of c tokens and the gradient w.r.t. its raw student logits.

    Args:
        s_h: [c, Ds] student hidden; s_w: [V, Ds]; t_h: [c, Dt] or None; t_w: [V, Dt] or None;
        labels: [c] or None; scale: 1 / normalizer (float or 0-dim tensor).
    Returns:
        kl_sum, ce_sum: 0-dim fp32/fp64 sums over the chunk (unweighted, unnormalised);
        grad: [c, V] d(loss)/d(raw student logits), already weighted and divided by normalizer
        (in the matmul dtype on the compiled path, fp32/fp64 otherwise).
    """
    z = _mm_fp32(s_h, s_w.t())  # [c, V]
    with_ce = bool(cfg.ce_weight) and labels is not None
    tz = _mm_fp32(t_h, t_w.t()) if cfg.kl_weight else None  # [c, V] teacher logits, no grad
    if cfg.kernel != "eager":
        # 0-dim device tensors built by kernels (a host-to-device copy would make the host wait for
        # the GPU). d/d(raw logits) = d/d(logits / T) / T: no T^2 factor (Liger's convention too).
        scale_t = scale if torch.is_tensor(scale) else z.new_full((), scale)
        fused = chunk_grad_triton if cfg.kernel == "triton" else compiled_chunk_grad
        kl, ce, grad = fused(z, tz, labels if with_ce else None,
                             scale_t * (cfg.kl_weight / cfg.temperature), scale_t * cfg.ce_weight,
                             1.0 / cfg.temperature, cfg.ignore_index, cfg.beta, s_h.dtype)
        return kl.sum(), ce.sum(), grad
    zero = z.new_zeros(())
    grad, ce_sum = None, zero
    if with_ce:
        ce, grad = _ce_(z, labels, cfg.ignore_index)  # CE always at temperature 1 (hard labels)
        ce_sum = ce.sum()
        grad.mul_(cfg.ce_weight * scale)
    if tz is None:
        return zero, ce_sum, grad
    if cfg.temperature != 1.0:
        z.div_(cfg.temperature), tz.div_(cfg.temperature)
    kl, g_kl = _divergence_(_log_softmax_(z), _log_softmax_(tz), cfg.beta)
    g_kl.mul_(cfg.kl_weight * scale / cfg.temperature)  # no T^2 factor, as above
    return kl.sum(), ce_sum, g_kl if grad is None else g_kl.add_(grad)


class FusedDistillFunction(torch.autograd.Function):
    """Autograd function: (student_hidden, student_weight, teacher_hidden, teacher_weight, labels)
    -> (loss, kl_sum, ce_sum). Only ``loss`` is differentiable; the teacher gets no gradient.

    ``loss = (kl_weight * kl_sum + ce_weight * ce_sum) / normalizer`` (fp32 scalar; fp64 for fp64
    inputs). The weight is never saved, so backward works after ZeRO-3 re-partitions it.
    """

    @staticmethod
    def forward(ctx, s_h, s_w, t_h, t_w, labels, cfg: ChunkConfig, normalizer):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = torch.promote_types(s_h.dtype, torch.float32)
        grad_h = torch.empty_like(s_h) if need_h else None
        grad_w = torch.zeros(s_w.shape, dtype=acc, device=s_w.device) if need_w else None
        kl_sum = torch.zeros((), dtype=acc, device=s_h.device)
        ce_sum = torch.zeros_like(kl_sum)
        if torch.is_tensor(normalizer):  # e.g. an all-reduced int64 count: divide in acc precision
            normalizer = normalizer.to(device=s_h.device, dtype=acc)
        scale = 1.0 / normalizer
        for start in range(0, s_h.shape[0], cfg.chunk_size):
            sl = slice(start, start + cfg.chunk_size)
            h_c = s_h[sl]
            kl, ce, g = _chunk(h_c, s_w, None if t_h is None else t_h[sl], t_w,
                               None if labels is None else labels[sl], cfg, scale)
            kl_sum += kl
            ce_sum += ce
            if g is None:  # no active term (kl.py's validation rules this out): zero grad
                if need_h:
                    grad_h[sl] = 0
                continue
            g = g.to(s_h.dtype)  # [c, V] low-precision copy for the tensor-core matmuls
            if need_h:
                grad_h[sl] = g @ s_w
            if need_w:
                _addmm_fp32_(grad_w, g.t(), h_c)  # fp32 accumulation over chunks
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(s_w.dtype))
        ctx.mark_non_differentiable(kl_sum, ce_sum)
        loss = (cfg.kl_weight * kl_sum + cfg.ce_weight * ce_sum) * scale
        return loss, kl_sum, ce_sum

    @staticmethod
    def backward(ctx, grad_loss, _grad_kl, _grad_ce):
        grad_h, grad_w = ctx.saved_tensors
        # The loss is the last op: the incoming gradient is a scalar (1 unless the caller rescales).
        grad_h = None if grad_h is None else grad_h * grad_loss.to(grad_h.dtype)
        grad_w = None if grad_w is None else grad_w * grad_loss.to(grad_w.dtype)
        return grad_h, grad_w, None, None, None, None, None
