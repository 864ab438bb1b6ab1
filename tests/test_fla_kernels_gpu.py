"""The RNN mixers' CUDA paths (fla's Triton kernels, or the Hopper fallback the dispatcher picks)
against the exact torch references of ``ops_rnn_torch`` run in fp32: output, final state and every
input gradient, dense and packed (cu_seqlens), and step-by-step decode, at HypeNet-2B's head shapes
(16 heads x 128). Inputs are bf16 (the decays fp32, as the mixers pass them), so each relative error
sits at bf16's rounding (H200 runs of 2026-11-30 and 12-03: 2.3e-3 to 5.4e-3); 2**-6 leaves room for
another card and Triton version, while a wrong gate, mask or document boundary is off by O(1)."""

import pytest
import torch
from conftest import rel_err
import torch.nn.functional as F

from halo_dist.models.hypenet import ops_rnn as ops
from halo_dist.models.hypenet import ops_rnn_torch as ref

pytestmark = pytest.mark.cuda
TOL = 2**-6
T, H, D = 1024, 16, 128
SCALE = D**-0.5
DISPATCH = {"gla": ops.gla_attention, "mamba2": ops.mamba2_attention,
            "gdn": ops.gated_delta_attention, "rwkv7": ops.rwkv7_attention}


def cu_seqlens(n: int) -> torch.Tensor:
    """Four documents in one row, one of them 7 tokens long."""
    return torch.tensor([0, n // 8, n // 2, n // 2 + 7, n], dtype=torch.int32, device="cuda")


def mixer_inputs(kind: str, n: int, seed: int = 0) -> list[torch.Tensor]:
    """(q, k, v, *gates) in fp32, each gate in the range its mixer produces."""
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    ru = lambda *s: torch.rand(*s, generator=g)  # noqa: E731
    q, k, v = rn(1, n, H, D), rn(1, n, H, D), rn(1, n, H, D)
    q, k = F.normalize(q, dim=-1) * D**0.5, F.normalize(k, dim=-1) * D**0.5  # what QK-norm gives
    if kind == "gla":
        gates = [F.logsigmoid(rn(1, n, H, D) + 3) / 16]
    elif kind == "mamba2":
        gates = [-(ru(1, n, H) * 0.2 + 0.005)]
    elif kind == "gdn":
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        gates = [-(ru(1, n, H) * 0.2 + 0.005), ru(1, n, H)]
    else:  # rwkv7: log decay w, then the rank-1 update's a = -kk and b = kk * a
        kk = F.normalize(rn(1, n, H, D), dim=-1)
        gates = [ops.RWKV7_LOG_DECAY_MIN * ru(1, n, H, D), -kk, kk * ru(1, n, H, D)]
    return [t.cuda() for t in (q, k, v, *gates)]


def bf16_inputs(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """bf16 q, k, v and the other gates; the decay (index 3) stays fp32."""
    return [t.detach().clone() if i == 3 else t.detach().to(torch.bfloat16)
            for i, t in enumerate(xs)]


def reference(kind, xs, cu=None, init=None):
    if kind == "gla":
        return ref.gla_chunk_torch(*xs, SCALE, init, cu, chunk_size=16)
    if kind == "mamba2":
        return ref.lightning_chunk_torch(*xs, SCALE, init, cu, chunk_size=64)
    if kind == "gdn":
        return ref.gdn_chunk_torch(*xs, SCALE, init, cu, chunk_size=64)
    q, k, v, w, a, b = xs
    return ref.dplr_torch(q, k, v, a, b, w, SCALE, init, cu)


def train_errors(fast_fn, ref_fn, xs, fast_xs) -> list[float]:
    """Errors of the output, the final state and every input's gradient under one upstream
    gradient."""
    do = torch.randn(xs[2].shape, device="cuda")
    outs = []
    for fn, ins in ((fast_fn, fast_xs), (ref_fn, xs)):
        ins = [t.detach().clone().requires_grad_() for t in ins]
        o, s = fn(ins)
        (o.float() * do).sum().backward()
        outs.append([o.float(), s.float()] + [t.grad.float() for t in ins])
    return [rel_err(a, b) for a, b in zip(*outs)]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("kind", sorted(DISPATCH))
def test_sweep_mixer_trains_like_its_reference(kind, packed):
    cu = cu_seqlens(T) if packed else None
    xs = mixer_inputs(kind, T)
    errors = train_errors(lambda ins: DISPATCH[kind](*ins, SCALE, cu_seqlens=cu),
                          lambda ins: reference(kind, ins, cu), xs, bf16_inputs(xs))
    assert max(errors) < TOL, errors


@pytest.mark.parametrize("kind", sorted(DISPATCH))
@torch.no_grad()
def test_sweep_mixer_forward_and_decode_equal_its_reference(kind):
    """Inference always runs fla (no Hopper fallback): the packed forward, then 32 decode steps
    from a non-zero state."""
    cu = cu_seqlens(T)
    xs = mixer_inputs(kind, T, seed=1)
    o, s = DISPATCH[kind](*bf16_inputs(xs), SCALE, cu_seqlens=cu)
    o_ref, s_ref = reference(kind, xs, cu)
    xs = mixer_inputs(kind, 32, seed=2)
    init = torch.randn(1, H, D, D, device="cuda") * 0.1
    fast, state, steps = bf16_inputs(xs), init, []
    for t in range(32):
        step, state = DISPATCH[kind](*(x[:, t:t + 1] for x in fast), SCALE, initial_state=state,
                                     decode=True)
        steps.append(step.float())
    d_ref, ds_ref = reference(kind, xs, init=init)
    errors = [rel_err(o, o_ref), rel_err(s, s_ref), rel_err(torch.cat(steps, 1), d_ref),
              rel_err(state, ds_ref)]
    assert max(errors) < TOL, errors


def lightning(ins, fla: bool, **kw):
    """``ops.lightning_attention`` on fla (``fla``) or on its torch path, the same call."""
    saved = ops._HAS_FLA
    ops._HAS_FLA = saved and fla
    try:
        return ops.lightning_attention(*ins, ops.lightning_log_decay(H, "cuda"), SCALE, **kw)
    finally:
        ops._HAS_FLA = saved


@pytest.mark.parametrize("case", ["dense", "left-padded", "packed"])
def test_lightning_trains_like_its_torch_path(case):
    mask = torch.ones(1, T, dtype=torch.bool, device="cuda")
    mask[:, : T // 4] = False  # padding: k = v = 0 there
    kw = {"token_mask": mask} if case == "left-padded" else {}
    kw |= {"cu_seqlens": cu_seqlens(T)} if case == "packed" else {}
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, T, H, D, generator=g).cuda() for _ in range(3)]
    errors = train_errors(lambda ins: lightning(ins, True, **kw),
                          lambda ins: lightning(ins, False, **kw),
                          xs, [x.to(torch.bfloat16) for x in xs])
    assert max(errors) < TOL, errors


@torch.no_grad()
def test_lightning_decode_steps_equal_its_torch_path():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 64, H, D, generator=g).cuda() for _ in range(3))
    init = torch.randn(1, H, D, D, device="cuda") * 0.1
    runs = []
    for fla, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        state, steps = init, []
        for t in range(64):
            o, state = lightning([x[:, t:t + 1].to(dtype) for x in (q, k, v)], fla,
                                 initial_state=state, decode=True)
            steps.append(o.float())
        runs.append((torch.cat(steps, 1), state.float()))
    errors = [rel_err(a, b) for a, b in zip(*runs)]
    assert max(errors) < TOL, errors
