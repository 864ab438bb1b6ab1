"""Fused, chunked distillation losses over the full vocabulary (stages 2/3 and OPAL).

Given the final hidden states and lm_head weights of a student and a frozen teacher, computes per
token t (valid tokens only) and sums over tokens:

* ``direction="forward"`` (stages 2/3, default): KL(p_t || q_t) = sum_v p log(p / q)
* ``direction="reverse"`` (on-policy stage):       KL(q_t || p_t) = sum_v q log(q / p)
* or ``beta`` in [0, 1] instead of ``direction``, the generalized JSD of TRL's GKD (and
  Liger-Kernel's JSD): beta = 0 is the forward KL, beta = 1 the reverse KL, and 0 < beta < 1
  beta KL(p_t || m_t) + (1 - beta) KL(q_t || m_t) with m = beta p + (1 - beta) q (which tends to 0,
  not to a KL, at the ends: the endpoints are defined as the KLs, as there)
* optionally ``ce_weight`` x cross-entropy of the student against ``labels`` (ignore_index -100),

where q = softmax(student_logits / T), p = softmax(teacher_logits / T). Units: nats.

Temperature convention: both logits are divided by T and the KL is **not** multiplied by T^2
(as Liger-Kernel's distillation losses do); gradients w.r.t. the raw logits therefore
carry a 1/T factor. Pass ``kl_weight=T**2`` for Hinton's convention. The CE term always uses the
raw (T = 1) student logits.

Reduction: the differentiable ``loss`` is ``(kl_weight * kl_sum + ce_weight * ce_sum) / normalizer``
(``normalizer`` defaults to 1, i.e. the sum). Token-weighted reduction over sequence-parallel and
data-parallel ranks: all-reduce the valid-token count first (``num_tokens`` or ``token_mask.sum()``)
and pass ``normalizer = global_count / G``, where G is the number of ranks over which the engine
*averages* gradients (DeepSpeed: its data-parallel group, which includes the SP ranks when Ulysses
is on; G = 1 if gradients are summed). Then every token weighs the same whatever rank holds it.
Logging: ``all_reduce(kl_sum) / all_reduce(num_tokens)``.

Memory: the [N x V] logits of neither model are ever materialised. Tokens are processed in chunks
of ``chunk_size`` rows (default: sized from ``memory_budget_bytes``); the student gradient is
computed during forward (like Liger-Kernel's fused linear losses), so what survives until backward
is [N, Ds] + [V, Ds]. Masked tokens are dropped before any matmul (their hidden states may even be
NaN), which costs one host sync for the count.

Backends: ``"torch"`` (the eager chunks of ``_chunked.py``, checked against the float64 full-logits
reference), ``"compiled"`` (the same chunks with each chunk's divergence, CE and their gradient
compiled by torch.compile into a few fused passes over the chunk), ``"triton"`` (the same chunks
with the forward or reverse KL, CE and their gradient from our Triton kernel in two passes over the
chunk's logits, ``_triton_kl.py``) and ``"auto"`` (on CUDA triton where it applies, else compiled;
torch on CPU: the fastest on the H200, BENCHMARKS.md). All return identical quantities.

ZeRO-3: gather the lm_head (``deepspeed.zero.GatheredParameters``) around the call. The weight may
be a leaf parameter or a non-leaf tensor; it is not saved for backward (the gradient is), so
backward also works after the gathered weight has been released.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from halo_dist.losses._chunked import ChunkConfig, FusedDistillFunction, auto_chunk_size
from halo_dist.losses._triton_kl import kernel_runs_on

DIRECTIONS = ("forward", "reverse")
DIRECTION_BETA = {"forward": 0.0, "reverse": 1.0}  # the same divergence as a generalized-JSD beta
BACKENDS = ("auto", "torch", "compiled", "triton")


def triton_applies(device: torch.device, beta: float, dtype: torch.dtype) -> bool:
    """Whether the ``triton`` backend's kernel (``_triton_kl.py``) computes this loss: the forward
    or reverse KL (not the JSD between them) of fp32 logits (inputs of at most fp32), on tensors
    Triton runs on."""
    return (beta in (0.0, 1.0) and dtype in (torch.bfloat16, torch.float16, torch.float32)
            and kernel_runs_on(device))


@dataclass
class DistillLossOutput:
    """Result of :func:`fused_distill_loss`.

    Attributes:
        loss: differentiable 0-dim fp32 tensor, ``(kl_weight*kl_sum + ce_weight*ce_sum) /
        normalizer``. kl_sum: detached fp32 sum of per-token KL over valid tokens (nats,
        unweighted). ce_sum: detached fp32 sum of per-token CE over valid labelled tokens (0 without
        CE). num_tokens: int64 count of valid (KL) tokens on this rank. num_ce_tokens: int64 count
        of valid tokens whose label is not ignore_index. normalizer: the divisor used for ``loss``.
    """

    loss: torch.Tensor
    kl_sum: torch.Tensor
    ce_sum: torch.Tensor
    num_tokens: torch.Tensor
    num_ce_tokens: torch.Tensor
    normalizer: float | torch.Tensor = 1.0

    def mean(self) -> torch.Tensor:
        """Differentiable local token mean: weighted sum / max(num_tokens, 1) (single-rank use)."""
        return self.loss * (self.normalizer / self.num_tokens.clamp_min(1).to(self.loss.dtype))


def _flat(x: torch.Tensor | None, name: str, last_dim: bool = True) -> torch.Tensor | None:
    """[..., D] -> [N, D] (or [...] -> [N] for masks/labels)."""
    if x is None:
        return None
    if last_dim:
        if x.dim() < 2:
            raise ValueError(f"{name} must have shape [N, D] (or [..., D]); got {tuple(x.shape)}")
        return x.reshape(-1, x.shape[-1])
    return x.reshape(-1)


def _check_pair(h: torch.Tensor, w: torch.Tensor, who: str) -> None:
    """Hidden [N, D] and lm_head [V, D] of one model must agree in D, dtype and device."""
    if w.dim() != 2:
        raise ValueError(f"{who}_weight must have shape [V, D]; got {tuple(w.shape)}")
    if h.shape[1] != w.shape[1]:
        raise ValueError(f"{who}_hidden has hidden size {h.shape[1]} but {who}_weight is "
                         f"{tuple(w.shape)} (expected [V, {h.shape[1]}])")
    if h.dtype != w.dtype:
        raise ValueError(f"{who}_hidden is {h.dtype} but {who}_weight is {w.dtype}; cast one")
    if not h.dtype.is_floating_point:
        raise ValueError(f"{who} tensors must be floating point; got {h.dtype}")


def resolve_beta(direction: str | None, beta: float | None) -> float:
    """The divergence as a generalized-JSD ``beta`` from either option (None, None: forward KL)."""
    if beta is None:
        direction = "forward" if direction is None else direction
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}; got {direction!r}")
        return DIRECTION_BETA[direction]
    if direction is not None:
        raise ValueError(f"give direction or beta, not both (got direction={direction!r}, "
                         f"beta={beta})")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
        raise ValueError("beta must be a number in [0, 1] (0 forward KL, 1 reverse KL); got "
                         f"{beta!r}")
    return float(beta)


def _validate(s_h, s_w, t_h, t_w, mask, labels, cfg_kwargs) -> None:
    """Clear errors for every inconsistent input (shapes, vocab, dtypes, devices, options)."""
    temperature = cfg_kwargs["temperature"]
    kl_weight, ce_weight = cfg_kwargs["kl_weight"], cfg_kwargs["ce_weight"]
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if kl_weight < 0 or ce_weight < 0 or not (kl_weight or ce_weight):
        raise ValueError(f"need kl_weight >= 0, ce_weight >= 0, not both 0; got {kl_weight}, "
                         f"{ce_weight}")
    if ce_weight and labels is None:
        raise ValueError("ce_weight > 0 needs labels")
    _check_pair(s_h, s_w, "student")
    tensors = [s_h, s_w]
    if kl_weight:
        if t_h is None or t_w is None:
            raise ValueError("kl_weight > 0 needs teacher_hidden and teacher_weight")
        _check_pair(t_h, t_w, "teacher")
        if s_w.shape[0] != t_w.shape[0]:
            raise ValueError(f"vocabulary mismatch: student_weight has V={s_w.shape[0]}, "
                             f"teacher_weight has V={t_w.shape[0]} (tokenizers must match)")
        if t_h.shape[0] != s_h.shape[0]:
            raise ValueError(f"token count mismatch: student_hidden has {s_h.shape[0]} tokens, "
                             f"teacher_hidden has {t_h.shape[0]}")
        tensors += [t_h, t_w]
    for name, x, dtypes in (("token_mask", mask, (torch.bool,)),
                            ("labels", labels, (torch.int64, torch.int32))):
        if x is None:
            continue
        if x.shape[0] != s_h.shape[0]:
            raise ValueError(f"{name} has {x.shape[0]} entries for {s_h.shape[0]} tokens")
        if x.dtype not in dtypes:
            raise ValueError(f"{name} must be {dtypes}; got {x.dtype}")
        tensors.append(x)
    if len({x.device for x in tensors}) > 1:
        raise ValueError("all inputs must be on one device; got "
                         f"{sorted({str(x.device) for x in tensors})}")


def _check_labels(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Out-of-range labels would silently gather garbage (CPU) or fault (CUDA): refuse them."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        raise ValueError(f"labels must be in [0, {vocab}) or {ignore_index}; "
                         f"got e.g. {labels[bad][0].item()}")


def _compact(mask, *xs):
    """Keep only rows where ``mask`` is True (index_select: autograd scatters grads back)."""
    if mask is None or bool(mask.all()):
        return xs
    idx = mask.nonzero().squeeze(-1)
    return tuple(None if x is None else x.index_select(0, idx) for x in xs)


def _pick_backend(backend: str, device: torch.device, n_rows: int, beta: float = 0.0,
                  dtype: torch.dtype = torch.bfloat16) -> str:
    """The backend that runs for ``backend`` on ``device``'s ``[n_rows, .]`` ``dtype`` inputs
    with the divergence ``beta``; an explicit backend that cannot run there is refused."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if backend == "triton" and not triton_applies(device, beta, dtype):
        raise ValueError(
            f"backend='triton' needs Triton, CUDA tensors (or TRITON_INTERPRET=1), inputs of at "
            f"most fp32 and the forward or reverse KL (beta 0 or 1); got {device.type}, {dtype}, "
            f"beta={beta}")
    if n_rows == 0:
        return "torch"  # nothing to compute: no kernel to compile or launch
    if backend == "auto":
        # Measured on the H200 (BENCHMARKS.md): at 24,576 tokens x 151,936 vocab the compiled chunk
        # ran forward+backward in 171 ms vs 265 ms for the eager torch chunk, with the same error
        # against the float64 reference, and lifted stage 2 (2B) from 54% to 63% MFU; reverse KL
        # (OPD) makes the same passes. CPU, where compiling costs more than it saves, stays on
        # torch.
        # The triton kernel reads a chunk's logits twice where the compiled code reads them about
        # four times (same quantities, same error against float64): 2.78 vs 4.34 ms per
        # 4,096-token chunk (forward KL; reverse 2.81 vs 5.52). It takes the forward and reverse KL;
        # the JSD stays compiled.
        if device.type != "cuda":
            return "torch"
        return "triton" if triton_applies(device, beta, dtype) else "compiled"
    return backend


def fused_distill_loss(
    student_hidden: torch.Tensor, student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor | None, teacher_weight: torch.Tensor | None,
    *,
    token_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
    direction: str | None = None, beta: float | None = None, temperature: float = 1.0,
    kl_weight: float = 1.0, ce_weight: float = 0.0, ignore_index: int = -100,
    normalizer: float | torch.Tensor | None = None,
    chunk_size: int | None = None, memory_budget_bytes: int = 2 << 30, backend: str = "auto",
) -> DistillLossOutput:
    """Token-level KL (+ optional CE) between student and teacher over the full vocabulary.

    Args:
        student_hidden: [N, Ds] (or [..., Ds]) final hidden states (after the final norm).
        student_weight: [V, Ds] student lm_head weight (tied embedding or not).
        teacher_hidden: [N, Dt] teacher final hidden states; no gradient flows to it.
            May be None when ``kl_weight == 0`` (CE-only, e.g. stage 3 ``objective: ce``).
        teacher_weight: [V, Dt] teacher lm_head weight; V must equal the student's. token_mask: [N]
        bool; False tokens contribute nothing (padding, prompts in OPAL). labels: [N] int64
        next-token targets for the CE term; ``ignore_index`` entries skipped. direction: "forward" =
        KL(teacher || student) (the default); "reverse" = KL(student || teacher). beta: instead of
        ``direction``, the generalized JSD's interpolation in [0, 1] (module doc):
            0 = forward KL, 1 = reverse KL.
        temperature: T > 0 for both softmaxes of the KL term (no T^2 factor, see module doc).
        kl_weight, ce_weight: weights of the two sums in ``loss``.
        normalizer: divide the weighted sum by this (e.g. the global valid-token count, a float or
            0-dim tensor; clamp an all-reduced count with ``clamp_min(1)``); None -> 1.
        chunk_size: token rows per chunk; None -> from budget.
        memory_budget_bytes: transient memory per chunk used when ``chunk_size`` is None.
        backend: "auto" | "torch" | "compiled" (torch.compile per chunk) | "triton" (our kernel
            per chunk; forward/reverse KL).
    Returns:
        DistillLossOutput (``loss`` differentiable; sums and counts for cross-rank reduction).
    """
    opts = dict(beta=resolve_beta(direction, beta), temperature=float(temperature),
                kl_weight=float(kl_weight), ce_weight=float(ce_weight), ignore_index=ignore_index)
    s_h, t_h, teacher_weight, labels = _prepare(student_hidden, student_weight, teacher_hidden,
                                                teacher_weight, token_mask, labels, opts)
    cfg = _chunk_config(s_h, student_weight.shape[0], chunk_size, memory_budget_bytes, backend,
                        opts)
    norm = 1.0 if normalizer is None else normalizer
    if not torch.is_tensor(norm) and not norm > 0:  # tensors are not checked (no host sync)
        raise ValueError(f"normalizer must be > 0; got {normalizer}")
    # Autocast would silently re-cast our fp32 matmuls to bf16: precision is handled explicitly.
    with torch.autocast(s_h.device.type, enabled=False):
        loss, kl_sum, ce_sum = FusedDistillFunction.apply(
            s_h, student_weight, t_h, teacher_weight, labels, cfg, norm)
    counts = _counts(s_h, labels, ignore_index)
    return DistillLossOutput(loss.float() if loss.dtype != torch.float64 else loss,
                             kl_sum.float(), ce_sum.float(), *counts, normalizer=norm)


def _prepare(student_hidden, student_weight, teacher_hidden, teacher_weight, token_mask, labels,
             opts):
    """Flattened, validated inputs with the masked-out tokens dropped:
    ``(s_h, t_h, teacher_weight, labels)`` (no teacher when the KL weight is 0: CE only never
    touches it)."""
    s_h, t_h = _flat(student_hidden, "student_hidden"), _flat(teacher_hidden, "teacher_hidden")
    mask, labels = _flat(token_mask, "token_mask", False), _flat(labels, "labels", False)
    _validate(s_h, student_weight, t_h, teacher_weight, mask, labels, opts)
    if not opts["kl_weight"]:
        t_h, teacher_weight = None, None
    if labels is not None:
        labels = labels.long()
        _check_labels(labels if mask is None else labels[mask], student_weight.shape[0],
                      opts["ignore_index"])
    s_h, t_h, labels = _compact(mask, s_h, t_h, labels)
    return s_h, t_h, teacher_weight, labels


def _chunk_config(s_h, vocab: int, chunk_size, memory_budget_bytes: int, backend: str,
                  opts) -> ChunkConfig:
    """The per-chunk settings, with the kernel of the backend that runs (``auto`` resolved)."""
    n = s_h.shape[0]
    if chunk_size is None:
        chunk_size = auto_chunk_size(vocab, memory_budget_bytes)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    which = _pick_backend(backend, s_h.device, n, opts["beta"], s_h.dtype)
    kernel = which if which in ("compiled", "triton") else "eager"
    return ChunkConfig(chunk_size=min(chunk_size, max(n, 1)), kernel=kernel, **opts)


def _counts(s_h, labels, ignore_index):
    """(valid KL tokens, valid CE tokens) as int64 tensors on the inputs' device (after
    compaction)."""
    # filled on the device: torch.tensor(..., device=cuda) is a blocking copy, a host sync per call
    n = torch.full((), s_h.shape[0], dtype=torch.int64, device=s_h.device)
    n_ce = torch.zeros_like(n) if labels is None else (labels != ignore_index).sum()
    return n, n_ce


class FusedDistillLoss(torch.nn.Module):
    """Module form of :func:`fused_distill_loss` with the options fixed at construction
    (configs)."""

    def __init__(self, direction: str | None = None, temperature: float = 1.0,
                 kl_weight: float = 1.0, ce_weight: float = 0.0, ignore_index: int = -100,
                 chunk_size: int | None = None, memory_budget_bytes: int = 2 << 30,
                 backend: str = "auto", beta: float | None = None):
        super().__init__()
        self.options = dict(direction=direction, beta=beta, temperature=temperature,
                            kl_weight=kl_weight, ce_weight=ce_weight, ignore_index=ignore_index,
                            chunk_size=chunk_size, memory_budget_bytes=memory_budget_bytes,
                            backend=backend)
        resolve_beta(direction, beta)
        if backend not in BACKENDS or not temperature > 0:
            raise ValueError(f"bad FusedDistillLoss options: {self.options}")

    def forward(self, student_hidden, student_weight, teacher_hidden, teacher_weight, *,
                token_mask=None, labels=None, normalizer=None) -> DistillLossOutput:
        return fused_distill_loss(student_hidden, student_weight, teacher_hidden, teacher_weight,
                                  token_mask=token_mask, labels=labels, normalizer=normalizer,
                                  **self.options)


def naive_distill_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, *,
                       token_mask=None, labels=None, direction=None, beta=None, temperature=1.0,
                       kl_weight=1.0, ce_weight=0.0, ignore_index=-100, normalizer=None,
                       upcast=True) -> DistillLossOutput:
    """Reference that materialises the full [N, V] logits (tests, benchmarks, tiny models only).

    Same conventions and return value as :func:`fused_distill_loss`. ``upcast=True`` computes the
    softmaxes in fp32 (at least); ``upcast=False`` reproduces the reference code's bf16 KL. The
    divergence is written with ``torch.nn.functional.kl_div`` and autograd differentiates it.
    """
    beta = resolve_beta(direction, beta)
    s_h, t_h = _flat(student_hidden, "student_hidden"), _flat(teacher_hidden, "teacher_hidden")
    mask = _flat(token_mask, "token_mask", False)
    mask = torch.ones(s_h.shape[0], dtype=torch.bool, device=s_h.device) if mask is None else mask
    up = (lambda x: x.to(torch.promote_types(x.dtype, torch.float32))) if upcast else (lambda x: x)
    z = up(s_h @ student_weight.t())  # [N, V]
    kl_sum = ce_sum = z.new_zeros(())
    if kl_weight:
        logq = torch.log_softmax(z / temperature, -1)
        logp = torch.log_softmax(up(t_h @ teacher_weight.t()).detach() / temperature, -1)
        # KL(target || input) per token
        kl_div = lambda inp, target: torch.nn.functional.kl_div(  # noqa: E731
            inp, target, reduction="none", log_target=True).sum(-1)
        if beta in (0.0, 1.0):
            kl = kl_div(logq, logp) if beta == 0.0 else kl_div(logp, logq)
        else:
            logm = torch.logsumexp(torch.stack([logq + math.log1p(-beta), logp + math.log(beta)]),
                                   dim=0)
            kl = beta * kl_div(logm, logp) + (1 - beta) * kl_div(logm, logq)
        kl_sum = (kl * mask).sum()
    n_ce = torch.zeros((), dtype=torch.int64, device=s_h.device)
    if ce_weight:
        lab = torch.where(mask, _flat(labels, "labels", False).long(), ignore_index)
        ce_sum = torch.nn.functional.cross_entropy(z, lab, ignore_index=ignore_index,
                                                   reduction="sum")
        n_ce = (lab != ignore_index).sum()
    norm = 1.0 if normalizer is None else normalizer
    loss = (kl_weight * kl_sum + ce_weight * ce_sum) / norm
    return DistillLossOutput(loss, kl_sum.detach().float(), ce_sum.detach().float(),
                             mask.sum(), n_ce, normalizer=norm)
