"""Ulysses all-to-alls: unit tests without processes, and one 2-rank gloo launch (float64) whose
scenarios are golden comparisons against single-process full-sequence attention."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from halo_dist.parallel import (
    SequenceParallel,
    SequenceParallelError,
    head_to_seq,
    kv_replication_factor,
    replicate_kv_heads,
    seq_to_head,
)
from distributed import run_distributed
from ulysses_golden import F64, attention_golden, max_err
from sp_testing import head_slice, kv_seq_to_head, seq_slice, shard_seq


# --- 2-rank scenarios --------------------------------------------------------------------------

def _layout_and_adjoint(sp: SequenceParallel) -> dict:
    """seq_to_head equals slicing the full tensor; round trips; <A x, y> = <x, A^T y> globally."""
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(2, 6, 4, 3, 2, generator=gen, dtype=F64)  # [B, T, H, *rest], rest = [3, 2]
    x = shard_seq(sp, full).clone().requires_grad_()
    y = sp.seq_to_head(x)
    res = {"layout": max_err(y, full[:, :, head_slice(sp, 4)]),
           "roundtrip": max_err(sp.head_to_seq(y), x)}
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(10 + sp.rank),
                           dtype=F64)
    (y * upstream).sum().backward()
    res["grad_is_head_to_seq"] = max_err(x.grad, sp.head_to_seq(upstream))
    dots = torch.stack([(y * upstream).sum(), (x * x.grad).sum()]).detach()
    dist.all_reduce(dots)
    res["adjoint"] = abs(dots[0] - dots[1]).item()
    no_rest = torch.randn(2, 3, 4, generator=gen, dtype=F64)  # [B, T/sp, H]: no trailing dims
    res["no_rest_shape"] = tuple(sp.seq_to_head(no_rest).shape)
    res["no_rest_roundtrip"] = max_err(sp.head_to_seq(sp.seq_to_head(no_rest)), no_rest)
    return res


def _gather_seq(sp: SequenceParallel) -> dict:
    """Forward equals the full tensor; backward 'sum' = block of the summed grads, 'slice' = own."""
    full = torch.randn(2, 6, 3, generator=torch.Generator().manual_seed(2), dtype=F64)
    weights = [torch.randn(2, 6, 3, generator=torch.Generator().manual_seed(20 + r), dtype=F64)
               for r in range(2)]
    res = {}
    for mode, expected in (("sum", weights[0] + weights[1]), ("slice", weights[sp.rank])):
        x = shard_seq(sp, full).clone().requires_grad_()
        gathered = sp.gather_seq(x, dim=1, grad=mode)
        (gathered * weights[sp.rank]).sum().backward()
        res[f"{mode}_fwd"] = max_err(gathered, full)
        res[f"{mode}_grad"] = max_err(x.grad, shard_seq(sp, expected))
    return res


def _error_message(fn) -> str:
    try:
        fn()
    except (SequenceParallelError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _bad_inputs(sp: SequenceParallel) -> dict:
    """Each bad shape gives a clear error (collected as text; the parent asserts on it)."""
    checked = SequenceParallel(sp.group, validate_shapes=True)
    uneven = torch.zeros(1, 3 + sp.rank, 2, 4, dtype=F64)  # rank 0 holds 3 tokens, rank 1 holds 4
    return {
        "heads": _error_message(lambda: sp.seq_to_head(torch.zeros(1, 2, 3, 4))),
        "seq": _error_message(lambda: sp.head_to_seq(torch.zeros(1, 3, 2, 4))),
        "kv_heads": _error_message(lambda: kv_seq_to_head(sp, torch.zeros(1, 2, 2, 4),
                                                          num_heads=5)),
        "uneven": _error_message(lambda: checked.seq_to_head(uneven)),
        "ndim": _error_message(lambda: sp.seq_to_head(torch.zeros(2, 4))),
        "grad_mode": _error_message(lambda: sp.gather_seq(torch.zeros(1, 2), grad="mean")),
        # the group is still usable after all of the above
        "after": max_err(checked.head_to_seq(checked.seq_to_head(torch.ones(1, 2, 2, 1))),
                         torch.ones(1, 2, 2, 1)),
    }


GOLDEN_CASES = {"mha_h4": (4, 4), "gqa_h4_kv2": (4, 2), "gqa_h4_kv1_replicated": (4, 1),
                "gqa_h6_kv3_replicated": (6, 3)}


def _two_rank_scenarios() -> dict:
    sp = SequenceParallel(dist.new_group([0, 1]))
    res = {name: attention_golden(sp, h, kv, seed=i)
           for i, (name, (h, kv)) in enumerate(GOLDEN_CASES.items())}
    res["layout"] = _layout_and_adjoint(sp)
    res["gather"] = _gather_seq(sp)
    res["bad"] = _bad_inputs(sp)
    res["sp"] = (sp.rank, sp.world_size, sp.enabled)
    return res


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_two_rank_scenarios, world_size=2, timeout=90, collective_timeout=20)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(GOLDEN_CASES))
def test_ulysses_attention_matches_full_attention(two_ranks, case):
    for rank, res in enumerate(two_ranks):
        assert max(res[case].values()) <= 1e-10, (rank, res[case])


@pytest.mark.slow
def test_all_to_all_layout_roundtrip_and_adjoint(two_ranks):
    for res in two_ranks:
        lay = res["layout"]
        assert lay["layout"] == 0 and lay["roundtrip"] == 0 and lay["no_rest_roundtrip"] == 0
        assert lay["grad_is_head_to_seq"] == 0
        assert lay["adjoint"] <= 1e-10
        assert lay["no_rest_shape"] == (2, 6, 2)
    assert [r["sp"] for r in two_ranks] == [(0, 2, True), (1, 2, True)]


@pytest.mark.slow
def test_gather_seq_forward_and_both_backward_modes(two_ranks):
    for res in two_ranks:
        assert max(res["gather"].values()) <= 1e-12, res["gather"]


@pytest.mark.slow
def test_bad_shapes_give_clear_errors(two_ranks):
    for res in two_ranks:
        bad = res["bad"]
        assert "H=3" in bad["heads"] and "sp=2" in bad["heads"]
        assert "T=3" in bad["seq"] and "sp=2" in bad["seq"]
        assert "H=5" in bad["kv_heads"]
        assert "different shapes" in bad["uneven"] and "(1, 3, 2, 4)" in bad["uneven"]
        assert "[B, T, H, ...]" in bad["ndim"]
        assert "'mean'" in bad["grad_mode"]
        assert bad["after"] == 0


# --- no processes ------------------------------------------------------------------------------

@pytest.mark.parametrize("h,kv,sp,factor", [(4, 4, 2, 1), (4, 2, 2, 1), (4, 1, 2, 2), (6, 3, 2, 2),
                                            (8, 2, 4, 2), (8, 1, 4, 4), (12, 4, 6, 3),
                                            (16, 8, 1, 1)])
def test_kv_replication_factor(h, kv, sp, factor):
    assert kv_replication_factor(h, kv, sp) == factor
    assert (kv * factor) % sp == 0 and h % (kv * factor) == 0


@pytest.mark.parametrize("h,kv,sp", [(4, 1, 2), (6, 3, 2), (8, 2, 4), (12, 4, 6), (6, 2, 3)])
def test_replicated_kv_keeps_gqa_mapping_per_rank(h, kv, sp):
    """Every query head finds, among its rank's local KV heads, a copy of the KV head it used."""
    kv_tensor = torch.arange(kv, dtype=F64).view(1, 1, kv, 1)  # head j holds value j
    rep = replicate_kv_heads(kv_tensor, h, sp)[0, 0, :, 0]  # [Hkv']
    local_q, local_kv = h // sp, rep.numel() // sp
    for i in range(h):
        rank, q = divmod(i, local_q)
        local_heads = rep[rank * local_kv:(rank + 1) * local_kv]
        assert local_heads[q // (local_q // local_kv)] == i // (h // kv)


def test_replication_errors_name_heads_and_sp():
    with pytest.raises(SequenceParallelError, match=r"H=6 .*sp=4"):
        kv_replication_factor(6, 2, 4)
    with pytest.raises(SequenceParallelError, match="multiple of 4 KV heads"):
        kv_replication_factor(6, 4, 2)


def test_no_sequence_parallel_is_identity():
    sp = SequenceParallel(None)
    x = torch.randn(2, 5, 3, 4)
    assert (sp.world_size, sp.rank, sp.enabled) == (1, 0, False)
    for out in (sp.seq_to_head(x), sp.head_to_seq(x), sp.gather_seq(x), shard_seq(sp, x),
                kv_seq_to_head(sp, x, num_heads=3), seq_to_head(x, None), head_to_seq(x, None)):
        assert out is x
    assert (head_slice(sp, 3) == slice(0, 3) and seq_slice(sp, 5) == slice(0, 5)
            and sp.local_heads(3) == 3)
