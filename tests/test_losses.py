"""Fused chunked distillation losses (halo_dist.losses) vs a full-logits reference and vs
Liger-Kernel's chunked loss (where liger-kernel is installed).

CPU, float64/float32 (bf16 for the precision test), V = 1000, N ~ 64: the whole file runs in
seconds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from halo_dist.losses import auto_chunk_size, fused_distill_loss, naive_distill_loss
from halo_dist.losses import kl as kl_mod
from halo_dist.losses.memtrack import LiveBytes
from triton_interp import HAS_TRITON, run_interpreted

torch.set_num_threads(1)
N, V, DS, DT = 64, 1000, 32, 48


def make(dtype=torch.float64, n=N, seed=0, scale=0.4):
    """Student/teacher hidden states and lm_heads ([N, Ds], [V, Ds], [N, Dt], [V, Dt]), a mask
    dropping ~20% of tokens, and labels with every 5th entry ignored."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    s_h = rnd(n, DS).to(dtype).requires_grad_()
    s_w = (rnd(V, DS) * scale).to(dtype).requires_grad_()
    t_h, t_w = rnd(n, DT).to(dtype), (rnd(V, DT) * scale).to(dtype)
    mask = torch.rand(n, generator=g) > 0.2
    labels = torch.randint(0, V, (n,), generator=g)
    labels[::5] = -100
    return s_h, s_w, t_h, t_w, mask, labels


def value_and_grads(fn, s_h, s_w, *rest, **kw):
    out = fn(s_h, s_w, *rest, **kw)
    return out, torch.autograd.grad(out.loss, [s_h, s_w])


def assert_rel(a, b, tol):
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    err = (a - b).abs().max() / b.abs().max().clamp_min(1e-30)
    assert err <= tol, f"relative error {err:.3g} > {tol}"


# ---------------------------------------------------------------- correctness vs full logits
@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("masked,ce", [(False, False), (True, False), (True, True), (False, True)])
def test_matches_naive_float64(direction, temperature, masked, ce):
    s_h, s_w, t_h, t_w, mask, labels = make()
    kw = dict(direction=direction, temperature=temperature, token_mask=mask if masked else None,
              labels=labels if ce else None, ce_weight=0.3 if ce else 0.0, normalizer=11.0)
    out, grads = value_and_grads(fused_distill_loss, s_h, s_w, t_h, t_w, chunk_size=7, **kw)
    ref, ref_grads = value_and_grads(naive_distill_loss, s_h, s_w, t_h, t_w, **kw)
    assert_rel(out.loss, ref.loss, 1e-10)
    assert_rel(out.kl_sum, ref.kl_sum, 1e-6)  # sums are reported in fp32
    for g, r in zip(grads, ref_grads):
        assert_rel(g, r, 1e-10)
    assert out.num_tokens.item() == (mask.sum().item() if masked else N)
    assert out.num_ce_tokens.item() == ref.num_ce_tokens.item()


def test_naive_reference_is_torch_kl_div():
    """Pin the reference itself to textbook formulas (forward and reverse KL, per token)."""
    s_h, s_w, t_h, t_w, _, _ = make()
    logq, logp = (s_h @ s_w.T).log_softmax(-1), (t_h @ t_w.T).log_softmax(-1)
    fwd = (logp.exp() * (logp - logq)).sum()
    rev = (logq.exp() * (logq - logp)).sum()
    assert_rel(naive_distill_loss(s_h, s_w, t_h, t_w).loss, fwd, 1e-12)
    assert_rel(naive_distill_loss(s_h, s_w, t_h, t_w, direction="reverse").loss, rev, 1e-12)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_float32_inputs_within_1e5_of_float64_reference(direction):
    s_h, s_w, t_h, t_w, mask, labels = make(torch.float32)
    kw = dict(direction=direction, temperature=1.5, token_mask=mask, labels=labels, ce_weight=0.5)
    out, grads = value_and_grads(fused_distill_loss, s_h, s_w, t_h, t_w, chunk_size=16, **kw)
    ref_in = [x.detach().double().requires_grad_(x.requires_grad) for x in (s_h, s_w, t_h, t_w)]
    ref, ref_grads = value_and_grads(naive_distill_loss, *ref_in, **kw)
    assert out.loss.dtype == torch.float32
    assert_rel(out.loss, ref.loss, 1e-5)
    for g, r in zip(grads, ref_grads):
        assert_rel(g, r, 1e-5)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_chunk_size_invariance(direction):
    s_h, s_w, t_h, t_w, mask, labels = make()
    kw = dict(direction=direction, token_mask=mask, labels=labels, ce_weight=1.0, temperature=0.7)
    base, base_g = value_and_grads(fused_distill_loss, s_h, s_w, t_h, t_w, chunk_size=N, **kw)
    for cs in (1, 7, 10_000, None):
        out, grads = value_and_grads(fused_distill_loss, s_h, s_w, t_h, t_w, chunk_size=cs, **kw)
        assert_rel(out.loss, base.loss, 1e-12)
        for g, r in zip(grads, base_g):
            assert_rel(g, r, 1e-12)


def test_auto_chunk_size_fits_budget():
    rows = auto_chunk_size(151_936, 2 << 30)
    assert rows % 128 == 0 and 128 <= rows <= 1024
    assert auto_chunk_size(151_936, 1) == 1


# ---------------------------------------------------------------- generalized JSD (beta, TRL's GKD)
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("masked,ce", [(False, False), (True, True)])
def test_beta_matches_naive_float64(beta, masked, ce):
    """Values and gradients of the generalized JSD against the full-logit float64 reference, with a
    token mask and CE labels holding ignore_index."""
    s_h, s_w, t_h, t_w, mask, labels = make()
    kw = dict(beta=beta, temperature=1.7, token_mask=mask if masked else None,
              labels=labels if ce else None, ce_weight=0.3 if ce else 0.0, normalizer=11.0)
    out, grads = value_and_grads(fused_distill_loss, s_h, s_w, t_h, t_w, chunk_size=7, **kw)
    ref, ref_grads = value_and_grads(naive_distill_loss, s_h, s_w, t_h, t_w, **kw)
    assert_rel(out.loss, ref.loss, 1e-10)
    assert_rel(out.kl_sum, ref.kl_sum, 1e-6)
    for g, r in zip(grads, ref_grads):
        assert_rel(g, r, 1e-10)
    assert out.num_tokens.item() == (mask.sum().item() if masked else N)
    kept = labels[mask] if masked else labels
    assert out.num_ce_tokens.item() == ref.num_ce_tokens.item() == (int((kept != -100).sum()) if ce
                                                                    else 0)


def test_naive_jsd_reference_is_the_textbook_formula():
    """beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q, from probabilities; the
    endpoints are the KLs; beta = 0.5 is symmetric in student and teacher."""
    s_h, s_w, t_h, t_w, _, _ = make()
    q, p = (s_h @ s_w.T / 2.0).softmax(-1), (t_h @ t_w.T / 2.0).softmax(-1)
    for beta in (0.25, 0.5, 0.8):
        m = beta * p + (1 - beta) * q
        jsd = beta * (p * (p / m).log()).sum() + (1 - beta) * (q * (q / m).log()).sum()
        assert_rel(naive_distill_loss(s_h, s_w, t_h, t_w, beta=beta, temperature=2.0).loss, jsd,
                   1e-12)
    swapped = naive_distill_loss(t_h, t_w, s_h, s_w, beta=0.5).loss
    assert_rel(naive_distill_loss(s_h, s_w, t_h, t_w, beta=0.5).loss, swapped, 1e-12)
    for beta, direction in ((0.0, "forward"), (1.0, "reverse")):
        a = fused_distill_loss(s_h, s_w, t_h, t_w, beta=beta, chunk_size=9)
        b = fused_distill_loss(s_h, s_w, t_h, t_w, direction=direction, chunk_size=9)
        assert torch.equal(a.loss, b.loss)  # the same code path: the default numerics are untouched


def test_jsd_masked_tokens_contribute_nothing_even_if_nan():
    s_h, s_w, t_h, t_w, mask, _ = make()
    with torch.no_grad():
        s_h[~mask] = float("nan")
        t_h[~mask] = float("inf")
    out, (g_h, g_w) = value_and_grads(fused_distill_loss, s_h, s_w, t_h, t_w, token_mask=mask,
                                      beta=0.5)
    ref = naive_distill_loss(s_h[mask], s_w, t_h[mask], t_w, beta=0.5)
    assert_rel(out.loss, ref.loss, 1e-10)
    assert torch.isfinite(g_w).all()
    assert (g_h[~mask] == 0).all() and torch.isfinite(g_h[mask]).all()


# ---------------------------------------------------------------- reduction, masking, CE
def test_token_weighted_reduction_over_ranks():
    """Two 'ranks' with unequal valid-token counts: normalizer = global count and summing grads
    gives exactly the single-process token mean (what SP x DP training needs)."""
    s_h, s_w, t_h, t_w, mask, _ = make()
    mask[:40] = True  # rank 0 holds more valid tokens than rank 1
    full = fused_distill_loss(s_h, s_w, t_h, t_w, token_mask=mask)
    mean_g = torch.autograd.grad(full.mean(), [s_h, s_w])
    total = mask.sum()  # = all_reduce(num_tokens)
    parts = [slice(0, 40), slice(40, N)]
    outs = [fused_distill_loss(s_h[p], s_w, t_h[p], t_w, token_mask=mask[p], normalizer=total)
            for p in parts]
    grads = torch.autograd.grad(sum(o.loss for o in outs), [s_h, s_w])
    assert_rel(sum(o.kl_sum for o in outs) / sum(o.num_tokens for o in outs), full.mean(), 1e-6)
    for g, r in zip(grads, mean_g):
        assert_rel(g, r, 1e-12)


def test_masked_tokens_contribute_nothing_even_if_nan():
    s_h, s_w, t_h, t_w, mask, _ = make()
    with torch.no_grad():
        s_h[~mask] = float("nan")
        t_h[~mask] = float("inf")
    out, (g_h, g_w) = value_and_grads(fused_distill_loss, s_h, s_w, t_h, t_w, token_mask=mask)
    assert torch.isfinite(out.loss) and torch.isfinite(g_w).all()
    assert (g_h[~mask] == 0).all() and torch.isfinite(g_h[mask]).all()


def test_all_tokens_masked_gives_zero():
    s_h, s_w, t_h, t_w, _, labels = make()
    none = torch.zeros(N, dtype=torch.bool)
    out, grads = value_and_grads(fused_distill_loss, s_h, s_w, t_h, t_w, token_mask=none,
                                 labels=labels, ce_weight=1.0)
    assert out.loss.item() == 0 and out.num_tokens.item() == 0 and out.mean().item() == 0
    assert all((g == 0).all() for g in grads)


def test_ce_only_needs_no_teacher_and_matches_cross_entropy():
    s_h, s_w, _, _, _, labels = make()
    out, (g_h, _) = value_and_grads(fused_distill_loss, s_h, s_w, None, None, labels=labels,
                                    kl_weight=0.0, ce_weight=1.0, chunk_size=5)
    ref = torch.nn.functional.cross_entropy(s_h @ s_w.T, labels, reduction="sum")
    assert_rel(out.loss, ref, 1e-12)
    assert_rel(g_h, torch.autograd.grad(ref, s_h)[0], 1e-12)
    assert out.num_ce_tokens.item() == (labels != -100).sum().item()


def test_mean_and_batched_shapes():
    s_h, s_w, t_h, t_w, mask, _ = make()
    out = fused_distill_loss(s_h.view(4, 16, DS), s_w, t_h.view(4, 16, DT), t_w,
                             token_mask=mask.view(4, 16))
    ref = naive_distill_loss(s_h, s_w, t_h, t_w, token_mask=mask)
    assert_rel(out.mean(), ref.loss / mask.sum(), 1e-10)


# ---------------------------------------------------------------- autograd plumbing (ZeRO-3 use)
def test_leaf_nonleaf_frozen_weights_and_no_teacher_grad():
    s_h, s_w, t_h, t_w, _, _ = make()
    param = torch.nn.Parameter(s_w.detach().clone())
    t_h.requires_grad_()
    # non-leaf weight (e.g. a cast or view of the gathered parameter): grads reach the leaf
    out = fused_distill_loss(s_h, param * 1.0, t_h, t_w)
    out.loss.backward()
    ref = naive_distill_loss(s_h.detach(), s_w, t_h.detach(), t_w)
    assert_rel(param.grad, torch.autograd.grad(ref.loss, s_w)[0], 1e-10)
    assert t_h.grad is None
    # frozen lm_head: only the hidden state gets a gradient
    s_h.grad = None
    fused_distill_loss(s_h, s_w.detach(), t_h, t_w).loss.backward()
    assert s_h.grad is not None
    with torch.no_grad():  # evaluation: no gradient bookkeeping at all
        assert fused_distill_loss(s_h, s_w, t_h, t_w).loss.requires_grad is False


def test_backward_does_not_need_the_weight_after_release():
    """Under ZeRO-3 the gathered lm_head is released/overwritten before backward: the gradient must
    not depend on it (autograd would also raise here if the weight had been saved for backward)."""
    s_h, s_w, t_h, t_w, _, _ = make()
    gathered = s_w.detach().clone().requires_grad_()
    out = fused_distill_loss(s_h, gathered, t_h, t_w)
    expected = torch.autograd.grad(naive_distill_loss(s_h, s_w, t_h, t_w).loss, s_w)[0]
    with torch.no_grad():
        gathered.fill_(float("nan"))  # in-place: bumps the version counter, poisons the values
    out.loss.backward()
    assert_rel(gathered.grad, expected, 1e-10)


# ---------------------------------------------------------------- bf16 precision
def test_bf16_inputs_accumulate_in_fp32():
    n = 128
    s_h, s_w, t_h, t_w, _, _ = make(torch.bfloat16, n=n, scale=0.5)
    ref_in = [x.detach().double().requires_grad_(x.requires_grad) for x in (s_h, s_w, t_h, t_w)]
    ref, (_, ref_gw) = value_and_grads(naive_distill_loss, *ref_in)
    out, (g_h, g_w) = value_and_grads(fused_distill_loss, s_h, s_w, t_h, t_w, chunk_size=1)
    assert out.loss.dtype == torch.float32 and g_h.dtype == g_w.dtype == torch.bfloat16
    assert_rel(out.loss, ref.loss, 1e-6)  # fp32 softmax/KL on exact logits
    bf16_kl = naive_distill_loss(s_h, s_w, t_h, t_w, upcast=False).loss  # the reference code's way
    assert (bf16_kl.double() - ref.loss).abs() > 20 * (out.loss.double() - ref.loss).abs()
    # lm_head grad summed over 128 one-token chunks in fp32, rounded to bf16 once ...
    ours = ((g_w.double() - ref_gw).norm() / ref_gw.norm()).item()
    # ... versus summing the same per-chunk contributions in bf16
    acc = torch.zeros_like(s_w)
    for i in range(n):
        w = s_w.detach().requires_grad_()
        acc += torch.autograd.grad(fused_distill_loss(s_h[i:i + 1].detach(), w, t_h[i:i + 1],
                                                      t_w).loss, w)[0]
    bf16_acc = ((acc.double() - ref_gw).norm() / ref_gw.norm()).item()
    assert ours < 4e-3 and bf16_acc > 2 * ours, (ours, bf16_acc)


def test_autocast_does_not_lower_precision():
    s_h, s_w, t_h, t_w, _, _ = make(torch.float32)
    plain = fused_distill_loss(s_h, s_w, t_h, t_w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = fused_distill_loss(s_h, s_w, t_h, t_w)
    assert_rel(auto.loss, plain.loss, 1e-7)


# ---------------------------------------------------------------- memory: no N x V tensors
def _peak(fn, n):
    s_h, s_w, t_h, t_w, _, _ = make(torch.float32, n=n)
    with LiveBytes([s_h, s_w, t_h, t_w]) as m:
        fn(s_h, s_w, t_h, t_w).loss.backward()
    return m.peak, m.biggest


def test_peak_memory_does_not_scale_with_tokens_times_vocab():
    chunk, row = 16, V * 4  # one fp32 vocabulary row, bytes
    fused = lambda *a: fused_distill_loss(*a, chunk_size=chunk, backend="torch")  # noqa: E731
    (f64, big64), (f512, big512) = _peak(fused, 64), _peak(fused, 512)
    (n64, _), (n512, _) = _peak(naive_distill_loss, 64), _peak(naive_distill_loss, 512)
    per_token_fused, per_token_naive = (f512 - f64) / 448, (n512 - n64) / 448
    assert per_token_naive >= row  # the tracker does see full-logit tensors
    assert per_token_fused <= 0.05 * row  # only [N, Ds]-sized growth (grad of hidden states)
    assert max(big64, big512) <= 4 * max(chunk * V, V * DS)  # no tensor beyond a chunk / lm_head
    assert f512 < n512 / 10


# ---------------------------------------------------------------- an independent implementation
def liger_sum(s_h, s_w, t_h, t_w, labels, *, beta, temperature, ce):
    """A sum over rows from Liger-Kernel's chunked JSD class (its pure-torch code, compiled=False):
    with ``ce`` its cross-entropy term alone over the rows whose label is not -100, else its
    divergence alone over every row. The class returns a mean over the rows whose label is not
    -100 (one label tensor masks both of its terms): hence one call per term, each multiplied back
    by its row count. Its beta is ours (0 forward KL, 1 reverse KL), its temperature divides both
    logits without a T^2 factor and its CE term uses the raw logits, as ours do."""
    jsd = pytest.importorskip("liger_kernel.chunked_loss.jsd_loss")
    if not ce:
        labels = torch.zeros(s_h.shape[0], dtype=torch.long)
    loss = jsd.LigerFusedLinearJSDLoss(weight_hard_loss=float(ce), weight_soft_loss=float(not ce),
                                       beta=beta, temperature=temperature, compiled=False,
                                       chunk_size=8)
    return loss(s_h, s_w, t_h, t_w, labels) * (labels != -100).sum()


@pytest.mark.parametrize("beta,temperature,ce", [
    (0.0, 1.0, True), (0.0, 2.0, True), (1.0, 1.0, True), (1.0, 2.0, True),  # forward, reverse KL
    (0.3, 1.5, False), (0.5, 1.5, False),  # the generalized JSD
])
def test_matches_liger_kernels_chunked_loss(beta, temperature, ce):
    """Loss, sums and gradients against Liger-Kernel's own chunked class (float64, masked tokens,
    CE labels holding ignore_index): an implementation written apart from ours and the reference."""
    s_h, s_w, t_h, t_w, mask, labels = make()
    ce_weight = 0.5 if ce else 0.0
    ours, g_ours = value_and_grads(fused_distill_loss, s_h, s_w, t_h, t_w, token_mask=mask,
                                   labels=labels if ce else None, beta=beta,
                                   temperature=temperature, ce_weight=ce_weight, chunk_size=8,
                                   normalizer=9.0, backend="torch")
    rows = (s_h[mask], s_w, t_h[mask], t_w, labels[mask])
    kl = liger_sum(*rows, beta=beta, temperature=temperature, ce=False)
    ce_sum = liger_sum(*rows, beta=beta, temperature=temperature, ce=True) if ce else 0.0
    loss = (kl + ce_weight * ce_sum) / 9.0
    assert_rel(loss, ours.loss, 1e-6)
    assert_rel(kl, ours.kl_sum, 1e-6)
    if ce:
        assert_rel(ce_sum, ours.ce_sum, 1e-6)
    for a, b in zip(torch.autograd.grad(loss, [s_h, s_w]), g_ours):
        assert_rel(a, b, 1e-6)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(t_w=a["t_w"][:999]), r"V=1000.*V=999"),
    (lambda a: a.update(t_h=a["t_h"][:10]), "token count mismatch"),
    (lambda a: a.update(s_w=a["s_w"][:, :5]), "hidden size 32"),
    (lambda a: a.update(token_mask=a["token_mask"].long()), "token_mask must be"),
    (lambda a: a.update(token_mask=a["token_mask"][:3]), "token_mask has 3 entries"),
    (lambda a: a.update(labels=torch.full((N,), V)), r"labels must be in \[0, 1000\)"),
    (lambda a: a.update(labels=None), "needs labels"),
    (lambda a: a.update(temperature=0.0), "temperature must be > 0"),
    (lambda a: a.update(direction="jsd"), "direction must be one of"),
    (lambda a: a.update(backend="cuda"), "backend must be one of"),
    (lambda a: a.update(chunk_size=0), "chunk_size must be >= 1"),
    (lambda a: a.update(normalizer=0), "normalizer must be > 0"),
    (lambda a: a.update(t_h=None), "needs teacher_hidden"),
    (lambda a: a.update(s_h=a["s_h"].float()), "cast one"),
    (lambda a: a.update(kl_weight=0.0, ce_weight=0.0), "not both 0"),
    (lambda a: a.update(s_h=a["s_h"][0]), r"shape \[N, D\]"),
])
def test_bad_input(change, match):
    s_h, s_w, t_h, t_w, mask, labels = make()
    args = dict(s_h=s_h, s_w=s_w, t_h=t_h, t_w=t_w, token_mask=mask, labels=labels, ce_weight=1.0)
    change(args)
    with pytest.raises(ValueError, match=match):
        fused_distill_loss(args.pop("s_h"), args.pop("s_w"), args.pop("t_h"), args.pop("t_w"),
                           **args)


@pytest.mark.parametrize("kw,match", [
    (dict(beta=1.5), r"beta must be a number in \[0, 1\]"),
    (dict(beta=-0.1), r"beta must be a number in \[0, 1\]"),
    (dict(beta="0.5"), r"beta must be a number"),
    (dict(beta=0.5, direction="reverse"), "give direction or beta, not both"),
])
def test_bad_beta(kw, match):
    s_h, s_w, t_h, t_w, _, _ = make()
    with pytest.raises(ValueError, match=match):
        fused_distill_loss(s_h, s_w, t_h, t_w, **kw)


def test_backend_selection(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert kl_mod._pick_backend("auto", cpu, 10) == "torch"
    monkeypatch.setattr(kl_mod, "kernel_runs_on", lambda device: device.type == "cuda")
    # on CUDA: the triton kernel for the forward and reverse KL, compiled for the JSD and fp64
    assert kl_mod._pick_backend("auto", cuda, 10) == "triton"
    assert kl_mod._pick_backend("auto", cuda, 10, beta=1.0) == "triton"
    assert kl_mod._pick_backend("auto", cuda, 10, beta=0.5) == "compiled"
    assert kl_mod._pick_backend("auto", cuda, 10, dtype=torch.float64) == "compiled"
    assert kl_mod._pick_backend("auto", cuda, 0) == "torch"
    monkeypatch.setattr(kl_mod, "kernel_runs_on", lambda device: False)  # no Triton
    assert kl_mod._pick_backend("auto", cuda, 10) == "compiled"


def test_bench_cpu_smoke(tmp_path):
    """bench/bench_kl.py keeps running (tiny shapes, CPU) and writes its JSON contract."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "bench_kl.py"
    spec = importlib.util.spec_from_file_location("bench_kl", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "kl.json"
    bench.main(["--cpu-smoke", "--iters", "1", "--warmup", "0", "--out", str(out)])
    result = json.loads(out.read_text())
    assert 0 < result["kl_peak_mem_ratio"] < 1
    assert {"device", "date", "versions"} <= result.keys()
    assert all(c["loss_rel_err"] < 1e-4
               for c in result["option_checks"] if c["backend"] != "naive_lowp")


def test_kl_max_position_trains_kl_inside_the_teachers_context_and_ce_beyond():
    """``loss.kl_max_position``: forward KL(teacher || student) on rows at document positions < P,
    next-token CE on the rest, one normalizer; value, token count and student gradients against full
    float64 logits."""
    import torch.nn.functional as F
    from conftest import tiny_qwen3

    from halo_dist.models.convert import convert_model
    from halo_dist.stages.distill import StudentWithLoss
    from halo_dist.models.convert import as_exact_hypenet

    torch.manual_seed(0)
    hf = tiny_qwen3(vocab=64)
    teacher = as_exact_hypenet(hf).double()
    student = convert_model(hf, [1]).double()
    ids = torch.randint(0, 64, (2, 12))
    # row 1: two documents
    pos = torch.stack([torch.arange(12), torch.cat([torch.arange(7), torch.arange(5)])])
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    labels[1, 6] = -100  # no target across the document boundary
    batch = {"input_ids": ids, "position_ids": pos, "labels": labels}
    P, norm = 5, 17.0
    module = StudentWithLoss(student, teacher, kl_max_position=P, chunk_size=7)
    loss, tracked, count = module(**batch, normalizer=norm)
    loss.backward()
    got = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
    student.zero_grad()

    h = student(ids, position_ids=pos, return_hidden_only=True).flatten(0, 1)
    with torch.no_grad():
        th = teacher(ids, position_ids=pos, return_hidden_only=True).flatten(0, 1)
    zs, zt = h @ student.lm_head.weight.T, th @ teacher.lm_head.weight.T  # [24, V] float64
    kl = (zt.softmax(-1) * (zt.log_softmax(-1) - zs.log_softmax(-1))).sum(-1)
    ce = F.cross_entropy(zs, labels.flatten(), ignore_index=-100, reduction="none")
    inside = pos.flatten() < P
    ref = (kl[inside].sum() + ce[~inside].sum()) / norm
    ref.backward()
    assert torch.allclose(loss, ref, rtol=1e-6, atol=1e-9), (loss, ref)
    assert (count == int(inside.sum() + ((labels.flatten() != -100) & ~inside).sum())
            == module.loss_tokens(batch) == 22)
    assert torch.allclose(tracked.double(), ref.detach() * norm, rtol=1e-6)
    for n, p in student.named_parameters():
        if p.grad is not None:
            assert torch.allclose(got[n], p.grad, rtol=1e-5, atol=1e-9), n
    # KL everywhere differs: the split is not a no-op
    everywhere = StudentWithLoss(student, teacher, chunk_size=7)(**batch, normalizer=norm)[0]
    assert not torch.allclose(everywhere, loss)


def test_kl_max_position_runs_the_teacher_on_document_prefixes_only():
    """With document boundaries the teacher sees only each document's first ``kl_max_position``
    tokens (packed as one row): the same hidden states as the full teacher at those tokens, so the
    same loss and gradients, while a document longer than the limit costs the teacher only the
    limit."""
    from conftest import tiny_qwen3

    from halo_dist.data.packing import pack_batch
    from halo_dist.models.convert import convert_model
    from halo_dist.stages.distill import StudentWithLoss
    from halo_dist.models.convert import as_exact_hypenet

    torch.manual_seed(0)
    hf = tiny_qwen3(vocab=64)
    teacher = as_exact_hypenet(hf).double()
    student = convert_model(hf, [1]).double()
    P = 5
    # rows of 12: documents of 7 + 5 tokens, then 3 + 9 (the row's cut makes the second row's first
    # segment)
    packed = pack_batch(torch.randint(0, 64, (24,)).numpy(), np.array([0, 7, 12, 15]), 2, 12)
    batch = {k: torch.as_tensor(v) if k != "max_seqlen" else v for k, v in packed.items()}
    cu, ids, pos = batch["cu_seqlens"], batch["input_ids"], batch["position_ids"]
    module = StudentWithLoss(student, teacher, kl_max_position=P, chunk_size=7)
    calls = []
    hook = teacher.register_forward_hook(lambda m, args, out: calls.append(args[0].numel()))
    with torch.no_grad():
        full = teacher(ids, position_ids=pos, cu_seqlens=cu, max_seqlen=batch["max_seqlen"],
                       return_hidden_only=True).flatten(0, 1)
    inside = pos.flatten() < P
    prefixes = module._teacher_prefixes(ids, pos, cu, batch["max_seqlen"])
    assert calls == [24, 5 + 5 + 3 + 5] and prefixes.shape == (int(inside.sum()), full.shape[-1])
    torch.testing.assert_close(prefixes, full[inside], rtol=1e-10, atol=1e-10)
    loss, tracked, count = module(**batch, normalizer=11.0)
    loss.backward()
    got = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
    student.zero_grad()
    hook.remove()
    # the reference: the full teacher's rows inside the limit, through the same split loss
    h = student(ids, position_ids=pos, cu_seqlens=cu, max_seqlen=batch["max_seqlen"],
                return_hidden_only=True)
    ref, ref_tracked, ref_count = module._split_loss(h.flatten(0, 1), full[inside],
                                                     teacher.lm_head.weight,
                                                     batch["labels"].flatten(), pos.flatten(), 11.0)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    assert count == ref_count and torch.allclose(tracked, ref_tracked)
    for n, p in student.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[n], p.grad, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.3])
def test_compiled_backend_matches_the_eager_chunked_path(beta):
    """backend='compiled' (each chunk's divergence and CE through torch.compile, inductor's CPU code
    here) gives the torch backend's loss, sums and gradients for forward KL, reverse KL and the
    generalized JSD; a shorter last chunk reuses the dynamic graph."""
    from halo_dist.losses._chunked import _COMPILED

    torch.manual_seed(0)
    n, d, v = 37, 16, 300  # chunk 16: 16 + 16 + 5 rows
    s_h, t_h = torch.randn(n, d, requires_grad=True), torch.randn(n, d)
    s_w = (torch.randn(v, d) * 0.3).requires_grad_()
    t_w = torch.randn(v, d) * 0.3
    labels = torch.randint(0, v, (n,))
    labels[::7] = -100
    out = {}
    for backend in ("torch", "compiled"):
        o = fused_distill_loss(s_h, s_w, t_h, t_w, labels=labels, ce_weight=0.3, normalizer=11.0,
                               chunk_size=16, temperature=1.5, beta=beta, backend=backend)
        gh, gw = torch.autograd.grad(o.loss, (s_h, s_w))
        out[backend] = (o.loss.detach(), o.kl_sum, o.ce_sum, gh, gw)
    assert out["torch"][1] > 0
    for a, b in zip(out["torch"], out["compiled"]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (a, b)
    assert "chunk_grad" in _COMPILED


@pytest.mark.parametrize("normalizer", [13.0, torch.tensor(13, dtype=torch.int64)])
def test_compiled_backend_cross_entropy_alone_and_bf16_inputs_match_the_torch_backend(normalizer):
    """The CE-only objective (from-scratch pretraining, stage 3's `objective: ce`) on the compiled
    path, with bf16 hidden states and weights as in training: same loss and sums as the torch
    backend, and the gradient written once in bf16 equals the torch backend's fp32 gradient rounded
    to bf16 (a tensor normalizer too: an all-reduced count)."""
    torch.manual_seed(1)
    n, d, v = 29, 16, 257
    s_h = torch.randn(n, d).bfloat16().requires_grad_()
    s_w = (torch.randn(v, d) * 0.3).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,))
    labels[::5] = -100
    out = {}
    for backend in ("torch", "compiled"):
        o = fused_distill_loss(s_h, s_w, None, None, labels=labels, kl_weight=0.0, ce_weight=1.0,
                               normalizer=normalizer, chunk_size=8, backend=backend)
        gh, gw = torch.autograd.grad(o.loss, (s_h, s_w))
        out[backend] = (o.loss.detach(), o.ce_sum, gh.float(), gw.float())
    assert out["compiled"][1] > 0
    for a, b in zip(out["torch"][:2], out["compiled"][:2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(out["torch"][2:], out["compiled"][2:]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize("kw,match", [
    (dict(beta=0.5), "beta=0.5"),             # the JSD: compiled backend only
    (dict(), "cpu"),                          # CPU tensors without Triton's interpreter
])
def test_triton_backend_refuses_what_its_kernel_does_not_compute(kw, match):
    s_h, s_w, t_h, t_w, _, _ = make(torch.float32)
    with pytest.raises(ValueError, match=match):
        fused_distill_loss(s_h, s_w, t_h, t_w, backend="triton", **kw)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_backend_in_the_interpreter_matches_the_torch_backend():
    """backend='triton' (the two-pass kernel of ``_triton_kl.py``, run by Triton's interpreter on
    CPU tensors) gives the torch backend's loss, sums and gradients: forward and reverse KL, a
    temperature, the CE term with ignored labels (with and without a KL), masked tokens, a shorter
    last chunk, a tensor normalizer, and rows of several vocabulary blocks ending in a partial one.
    bf16 inputs: the gradient written once in bf16 against the torch backend's fp32 one."""
    out = run_interpreted("""
        import torch
        from halo_dist.losses import fused_distill_loss
        from halo_dist.losses import _triton_kl

        _triton_kl.LAUNCH["block"] = 128  # 300 entries: 3 blocks per row, the last partial
        torch.manual_seed(0)
        n, d, v = 37, 16, 300  # chunk 16: 16 + 16 + 5 rows
        cases = [  # (beta, temperature, kl_weight, ce_weight, masked, dtype)
            (0.0, 1.0, 1.0, 0.0, False, torch.float32),  # stage 2
            (0.0, 1.5, 1.0, 0.3, True, torch.float32),
            (1.0, 1.0, 1.0, 0.0, True, torch.float32),  # OPD
            (1.0, 2.0, 0.7, 0.4, False, torch.float32),
            (0.0, 1.0, 0.0, 1.0, False, torch.float32),  # CE only: no teacher
            (0.0, 1.0, 1.0, 0.2, False, torch.bfloat16),
        ]
        for i, (beta, temp, kl_w, ce_w, masked, dtype) in enumerate(cases):
            s_h, t_h = torch.randn(n, d).to(dtype), torch.randn(n, d).to(dtype)
            s_w, t_w = (torch.randn(v, d) * 0.3).to(dtype), (torch.randn(v, d) * 0.3).to(dtype)
            s_h.requires_grad_(), s_w.requires_grad_()
            labels = torch.randint(0, v, (n,))
            labels[::7] = -100
            mask = torch.rand(n) > 0.2 if masked else None
            got = {}
            for backend in ("torch", "triton"):
                o = fused_distill_loss(s_h, s_w, t_h if kl_w else None, t_w if kl_w else None,
                                       labels=labels, token_mask=mask, beta=beta,
                                       temperature=temp, kl_weight=kl_w, ce_weight=ce_w,
                                       normalizer=torch.tensor(11), chunk_size=16,
                                       backend=backend)
                gh, gw = torch.autograd.grad(o.loss, (s_h, s_w))
                got[backend] = [o.loss.detach(), o.kl_sum, o.ce_sum, gh.float(), gw.float()]
            sums = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
                       for a, b in zip(got["triton"][:3], got["torch"][:3]))
            grads = max(float((a - b).norm() / b.norm())
                        for a, b in zip(got["triton"][3:], got["torch"][3:]))
            print("case", i, sums, grads, float(got["torch"][1]), float(got["torch"][2]))
    """)
    rows = [line.split()[1:] for line in out.splitlines() if line.startswith("case")]
    assert len(rows) == 6, out
    for i, sums, grads, kl, ce in rows:
        bf16 = i == "5"
        assert float(sums) < 1e-5, out  # sums in fp32 on both sides
        assert float(grads) < (1e-2 if bf16 else 1e-5), out
        assert (float(kl) > 0) == (i != "4") and (float(ce) > 0) == (i not in ("0", "2")), out


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("beta,ce", [(0.0, 0.0), (1.0, 0.0), (0.0, 0.5)])
def test_triton_backend_on_cuda_matches_the_compiled_backend(beta, ce):
    """On the GPU, bf16 as in training, a real vocabulary and chunk: the triton kernel and the
    compiled chunk agree to fp32 rounding in the sums and bf16 rounding in the gradients."""
    g = torch.Generator().manual_seed(0)
    n, d, v = 3000, 256, 151_936
    t_h, t_w = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g) * 0.05
    s_h = t_h + 0.3 * torch.randn(n, d, generator=g)
    s_w = t_w + 0.01 * torch.randn(v, d, generator=g)
    s_h, s_w, t_h, t_w = (x.cuda().bfloat16() for x in (s_h, s_w, t_h, t_w))
    s_h.requires_grad_(), s_w.requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g).cuda()
    labels[::7] = -100
    got = {}
    for backend in ("compiled", "triton"):
        o = fused_distill_loss(s_h, s_w, t_h, t_w, labels=labels, beta=beta, ce_weight=ce,
                               normalizer=float(n), chunk_size=1024, backend=backend)
        gh, gw = torch.autograd.grad(o.loss, (s_h, s_w))
        got[backend] = [o.loss.detach(), o.kl_sum, o.ce_sum, gh.float(), gw.float()]
    for a, b in zip(got["triton"][:3], got["compiled"][:3]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for a, b in zip(got["triton"][3:], got["compiled"][3:]):
        assert float((a - b).norm() / b.norm()) < 1e-2
