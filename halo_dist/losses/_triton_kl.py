"""One chunk's forward or reverse KL (+ CE) and its logit gradient in two passes over the logits
(the ``triton`` backend of ``kl.py``; same contract as ``_chunked._fused_chunk_grad``).

Each program owns one row of the chunk's fp32 ``[c, V]`` student and teacher logits:

* pass 1 reads both once, keeping running maxima and sums, so that it ends with the two
  log-sum-exps and the divergence: for the forward KL,
  ``KL(p || q) = sum_v p_v (b_v - a_v) + lse(a) - lse(b)`` with ``a = z / T``, ``b = t / T`` and
  ``sum_v p_v (b_v - a_v) = sum_v e^(b_v - m) (b_v - a_v) / sum_v e^(b_v - m)``, a sum that is
  rescaled whenever the running maximum ``m`` grows (the reverse KL swaps the roles);
* pass 2 reads them again and writes the gradient w.r.t. the raw student logits once, weighted
  and in the matmul dtype: ``q - p`` (forward), ``q (log q - log p - KL)`` (reverse), plus the CE's
  ``softmax(z) - onehot``.

Two reads of 8 bytes per (row, token) and one 2-byte write: the floor for a divergence whose
gradient needs both normalisers. On an H200, one 4,096 x 151,936 chunk: 2.78 ms forward KL
(4.0 TB/s), 2.81 ms reverse, against 4.34 and 5.52 ms for torch.compile's code of the same math
(the ``compiled`` backend, about four passes over the logits); stage 2 of the 2B model +0.8%
(BENCHMARKS.md). The generalized JSD (0 < beta < 1) is not written here: ``kl.py`` keeps it on the
compiled backend. ``TRITON_INTERPRET=1`` runs the kernel on CPU tensors (the CPU tests).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    HAS_TRITON = False

# vocabulary entries per loop iteration and warps per program (one program per row)
LAUNCH = {"block": 2048, "num_warps": 4}


def kernel_runs_on(device: torch.device) -> bool:
    """Whether the kernel can run on ``device``'s tensors: CUDA, or any under Triton's
    interpreter."""
    return HAS_TRITON and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


if HAS_TRITON:

    @triton.jit
    def _online(m, s, x):
        """Running (max, sum of e^(x - max)) after one block ``x`` (masked lanes at -inf); also
        the factor that rescales sums kept against the old max, and the block's e^(x - max)."""
        m_new = tl.maximum(m, tl.max(x, 0))
        rescale = tl.exp(m - m_new)
        e = tl.exp(x - m_new)
        return m_new, s * rescale + tl.sum(e, 0), rescale, e

    @triton.jit
    def _row_stats(z_row, t_row, V, inv_t, HAS_KL: tl.constexpr, REVERSE: tl.constexpr,
                   CE_OWN_LSE: tl.constexpr, BLOCK: tl.constexpr):
        """Pass 1 over one row: ``(lse(a), lse(b), KL, lse(z))`` with ``a = z / T``, ``b = t / T``
        (``lse(b)`` and KL 0 without a teacher; ``lse(z)`` is ``lse(a)`` unless CE_OWN_LSE)."""
        neg_inf = float("-inf")
        m_a = tl.full((), neg_inf, tl.float32)  # student: running max and sum
        s_a = tl.zeros((), tl.float32)
        m_b = tl.full((), neg_inf, tl.float32)  # teacher: running max and sum
        s_b = tl.zeros((), tl.float32)
        w = tl.zeros((), tl.float32)  # sum e^(b - m_b) (b - a) forward, e^(a - m_a) (a - b) reverse
        m_c = tl.full((), neg_inf, tl.float32)  # raw z (the CE when T != 1): max and sum
        s_c = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < V
            z = tl.load(z_row + offs, mask=ok, other=0.0).to(tl.float32)
            a = z * inv_t
            m_a, s_a, r_a, e_a = _online(m_a, s_a, tl.where(ok, a, neg_inf))
            if HAS_KL:
                # masked lanes: a = b = 0 and e = 0, so they add nothing to w
                b = tl.load(t_row + offs, mask=ok, other=0.0).to(tl.float32) * inv_t
                m_b, s_b, r_b, e_b = _online(m_b, s_b, tl.where(ok, b, neg_inf))
                if REVERSE:
                    w = w * r_a + tl.sum(e_a * (a - b), 0)
                else:
                    w = w * r_b + tl.sum(e_b * (b - a), 0)
            if CE_OWN_LSE:
                m_c, s_c, _, _ = _online(m_c, s_c, tl.where(ok, z, neg_inf))
        lse_a = m_a + tl.log(s_a)
        lse_b = 0.0
        kl = 0.0
        if HAS_KL:
            lse_b = m_b + tl.log(s_b)
            if REVERSE:
                kl = w / s_a + lse_b - lse_a
            else:
                kl = w / s_b + lse_a - lse_b
        lse_c = lse_a
        if CE_OWN_LSE:
            lse_c = m_c + tl.log(s_c)
        return lse_a, lse_b, kl, lse_c

    @triton.jit
    def _write_grad(z_row, t_row, g_row, V, inv_t, lse_a, lse_b, kl, lse_c, kl_scale, ce_scale,
                    label, HAS_KL: tl.constexpr, HAS_CE: tl.constexpr, REVERSE: tl.constexpr,
                    CE_OWN_LSE: tl.constexpr, BLOCK: tl.constexpr):
        """Pass 2 over one row: the weighted gradient w.r.t. the raw student logits, written
        once."""
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < V
            z = tl.load(z_row + offs, mask=ok, other=0.0).to(tl.float32)
            a = z * inv_t
            q = tl.exp(a - lse_a)
            grad = tl.zeros((BLOCK,), tl.float32)
            if HAS_KL:
                b = tl.load(t_row + offs, mask=ok, other=0.0).to(tl.float32) * inv_t
                if REVERSE:
                    grad = q * ((a - lse_a) - (b - lse_b) - kl) * kl_scale
                else:
                    grad = (q - tl.exp(b - lse_b)) * kl_scale
            if HAS_CE:
                soft = q
                if CE_OWN_LSE:
                    soft = tl.exp(z - lse_c)
                grad += ce_scale * (soft - tl.where(offs == label, 1.0, 0.0))
            tl.store(g_row + offs, grad.to(g_row.dtype.element_ty), mask=ok)

    @triton.jit
    def _kl_ce_rows_kernel(Z, T, Labels, KlFactor, CeFactor, Kl, Ce, Grad,
                           stride_z, stride_t, stride_g, V, inv_t, ignore_index,
                           HAS_KL: tl.constexpr, HAS_CE: tl.constexpr, REVERSE: tl.constexpr,
                           CE_OWN_LSE: tl.constexpr, BLOCK: tl.constexpr):
        """One program per row of the chunk: its KL and CE, then its gradient."""
        row = tl.program_id(0).to(tl.int64)
        z_row = Z + row * stride_z
        t_row = T + row * stride_t
        lse_a, lse_b, kl, lse_c = _row_stats(z_row, t_row, V, inv_t, HAS_KL, REVERSE, CE_OWN_LSE,
                                             BLOCK)
        kl_scale = 0.0
        if HAS_KL:
            tl.store(Kl + row, kl)
            kl_scale = tl.load(KlFactor)
        ce_scale = 0.0
        label = 0
        if HAS_CE:
            label = tl.load(Labels + row)
            valid = label != ignore_index
            label = tl.where(valid, label, 0)
            z_label = tl.load(z_row + label).to(tl.float32)
            tl.store(Ce + row, tl.where(valid, lse_c - z_label, 0.0))
            ce_scale = tl.where(valid, tl.load(CeFactor), 0.0)
        _write_grad(z_row, t_row, Grad + row * stride_g, V, inv_t, lse_a, lse_b, kl, lse_c,
                    kl_scale, ce_scale, label, HAS_KL, HAS_CE, REVERSE, CE_OWN_LSE, BLOCK)


def chunk_grad_triton(z: torch.Tensor, tz: torch.Tensor | None, labels: torch.Tensor | None,
                      kl_factor: torch.Tensor, ce_factor: torch.Tensor, inv_t: float,
                      ignore_index: int, beta: float,
                      out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_chunked._fused_chunk_grad``'s contract for ``beta`` 0 (forward KL) or 1 (reverse KL).

    Args:
        z: [c, V] raw student logits, fp32; tz: [c, V] raw teacher logits (fp32) or None (CE only).
        labels: [c] int64 or None (no CE); kl_factor, ce_factor: 0-dim fp32 tensors (weight /
            normalizer; the KL's with the 1 / T of the chain rule). inv_t: 1 / temperature.
    Returns:
        kl [c], ce [c] (fp32; zeros for an absent term) and grad [c, V] in ``out_dtype``.
    """
    if beta not in (0.0, 1.0):
        raise ValueError(f"the triton loss kernel computes the forward (beta 0) or reverse "
                         f"(beta 1) KL; got beta={beta} (the compiled backend has the JSD)")
    if z.dtype != torch.float32 or (tz is not None and tz.dtype != torch.float32):
        raise TypeError(f"the triton loss kernel reads fp32 logits; got {z.dtype}"
                        f"{'' if tz is None else f' and {tz.dtype}'}")
    if tz is None and labels is None:
        raise ValueError("chunk_grad_triton needs a KL term (tz) or a CE term (labels)")
    c, vocab = z.shape
    z = z if z.stride(-1) == 1 else z.contiguous()
    t = z if tz is None else (tz if tz.stride(-1) == 1 else tz.contiguous())
    kl = torch.zeros(c, device=z.device, dtype=torch.float32)
    ce = torch.zeros_like(kl)
    grad = torch.empty(c, vocab, device=z.device, dtype=out_dtype)
    if c == 0:
        return kl, ce, grad
    has_kl, has_ce = tz is not None, labels is not None
    kl_factor = kl_factor.to(device=z.device, dtype=torch.float32)
    ce_factor = ce_factor.to(device=z.device, dtype=torch.float32)
    _kl_ce_rows_kernel[(c,)](
        z, t, labels.contiguous() if has_ce else kl, kl_factor, ce_factor, kl, ce, grad,
        z.stride(0), t.stride(0), grad.stride(0), vocab, inv_t if has_kl else 1.0, ignore_index,
        HAS_KL=has_kl, HAS_CE=has_ce, REVERSE=beta == 1.0,
        CE_OWN_LSE=has_ce and has_kl and inv_t != 1.0,
        BLOCK=LAUNCH["block"], num_warps=LAUNCH["num_warps"])
    return kl, ce, grad
