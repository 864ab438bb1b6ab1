"""ParallelLayout arithmetic (no processes) and ProcessGroups on 4 gloo ranks (one launch): the mpu
methods, live collectives, and that the groups are megatron-core's parallel_state groups."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from halo_dist.parallel import LayoutError, ParallelLayout, ProcessGroups, SequenceParallel
from distributed import run_distributed
from ulysses_golden import attention_golden

# --- pure arithmetic ---------------------------------------------------------------------------


def test_coords_are_consecutive_sp_blocks():
    layout = ParallelLayout(world_size=8, sp_size=4)
    assert layout.dp_size == 2
    assert [layout.coords(r) for r in range(8)] == [(d, s) for d in range(2) for s in range(4)]
    assert all(layout.rank_of(*layout.coords(r)) == r for r in range(8))
    assert layout.all_sp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.all_dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("world,sp", [(1, 1), (4, 1), (4, 4), (6, 2), (16, 8)])
def test_groups_partition_the_world(world, sp):
    layout = ParallelLayout(world, sp)
    for groups, size, count in ((layout.all_sp_groups(), sp, world // sp),
                                (layout.all_dp_groups(), world // sp, sp)):
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert len(groups) == count and all(len(g) == size for g in groups)
    for rank in range(world):  # each rank's SP and DP groups meet only in that rank
        dp_rank, sp_rank = layout.coords(rank)
        assert set(layout.sp_group_ranks(dp_rank)) & set(layout.dp_group_ranks(sp_rank)) == {rank}


@pytest.mark.parametrize("kwargs,match", [
    (dict(world_size=6, sp_size=4), "world_size=6 is not divisible by sp_size=4"),
    (dict(world_size=0, sp_size=1), "world_size must be a positive int"),
    (dict(world_size=4, sp_size=0), "sp_size must be a positive int"),
    (dict(world_size=4, sp_size=2.0), "sp_size must be a positive int"),
])
def test_bad_layouts(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        ParallelLayout(**kwargs)


def test_rank_out_of_range():
    with pytest.raises(LayoutError, match="rank 8 out of range"):
        ParallelLayout(world_size=8, sp_size=2).coords(8)


# --- 4 ranks -----------------------------------------------------------------------------------

_MPU_INTS = ["get_data_parallel_world_size", "get_data_parallel_rank",
             "get_sequence_parallel_world_size", "get_sequence_parallel_rank",
             "get_sequence_data_parallel_world_size", "get_sequence_data_parallel_rank",
             "get_model_parallel_world_size", "get_model_parallel_rank",
             "get_tensor_model_parallel_world_size", "get_tensor_model_parallel_rank",
             "get_pipeline_model_parallel_world_size", "get_pipeline_model_parallel_rank",
             "get_tensor_model_parallel_src_rank"]
_MPU_GROUPS = ["get_data_parallel_group", "get_sequence_parallel_group",
               "get_sequence_data_parallel_group", "get_model_parallel_group",
               "get_tensor_model_parallel_group", "get_pipeline_model_parallel_group"]


def _describe(groups: ProcessGroups) -> dict:
    """Everything the parent checks about one rank's groups, including live collectives."""
    res = {"ints": {name: getattr(groups, name)() for name in _MPU_INTS},
           "ranks": {name: dist.get_process_group_ranks(getattr(groups, name)())
                     for name in _MPU_GROUPS},
           "dp_ranks_method": groups.get_data_parallel_group_ranks(),
           "has_initialize_sequence_parallel": hasattr(groups, "initialize_sequence_parallel")}
    for name in ("sp_group", "dp_group"):
        t = torch.tensor([float(groups.rank)])
        dist.all_reduce(t, group=getattr(groups, name))
        res[f"{name}_sum"] = t.item()
    return res


def _megatron_facts(groups: ProcessGroups) -> dict:
    """Whether ``groups`` holds the groups megatron's parallel_state holds now, and what megatron
    says."""
    from megatron.core import parallel_state as ps

    return {"same": {"sp": groups.sp_group is ps.get_context_parallel_group(),
                     "dp": groups.dp_group is ps.get_data_parallel_group(),
                     "sdp": groups.sdp_group is ps.get_data_parallel_group(
                         with_context_parallel=True),
                     "self": groups.self_group is ps.get_model_parallel_group()},
            "cp_global_ranks": ps.get_context_parallel_global_ranks(),
            "dp_ranks": dist.get_process_group_ranks(ps.get_data_parallel_group()),
            "cp": (ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()),
            "dp": (ps.get_data_parallel_world_size(), ps.get_data_parallel_rank())}


def _megatron_lifecycle() -> dict:
    """On a fresh rank (megatron-core not imported yet): the import, then repeated builds."""
    res = {"imported_before": "megatron.core" in sys.modules}
    safe_before = list(torch.serialization.get_safe_globals())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        two = ProcessGroups.build(sp_size=2)
    res["warnings"] = [(w.category.__name__, str(w.message)) for w in caught]
    from megatron.core import parallel_state as ps
    from megatron.core.safe_globals import SAFE_GLOBALS

    allowed = torch.serialization.get_safe_globals()
    res["megatron_safe_globals"] = [repr(g)
                                    for g in SAFE_GLOBALS if g in allowed and g not in safe_before]
    res["sp2"] = _megatron_facts(two)
    res["same_layout_reused"] = ProcessGroups.build(sp_size=2).sp_group is two.sp_group
    four = ProcessGroups.build(sp_size=4)
    res["sp4"], res["sp2_after_sp4"] = _megatron_facts(four), _megatron_facts(two)
    t = torch.tensor([float(two.rank)])
    dist.all_reduce(t, group=two.sp_group)  # a ProcessGroups built before still works
    res["old_sp_sum"] = t.item()
    with pytest.raises(LayoutError):
        ProcessGroups.build(sp_size=3)
    # refused before megatron was called
    res["cp_size_after_bad"] = ps.get_context_parallel_world_size()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=2, create_gloo_process_groups=False)
    try:
        ProcessGroups.build(sp_size=2)
        res["foreign"] = "no error"
    except RuntimeError as e:
        res["foreign"] = str(e)
    ps.destroy_model_parallel()
    return res


def _four_rank_scenarios() -> dict:
    out = {"megatron": _megatron_lifecycle()}
    for sp in (1, 2, 4):
        groups = ProcessGroups.build(sp_size=sp)
        out[sp] = _describe(groups)
        out[sp]["megatron"] = _megatron_facts(groups)
        if sp > 1:  # Ulysses inside an SP group that is not the world; replicas get different data
            sp_ctx = SequenceParallel(groups.sp_group)
            out[sp]["golden"] = max(max(attention_golden(sp_ctx, 8, kv,
                                                         seed=100 * groups.dp_rank + kv).values())
                                    for kv in (8, 2, 1))
    try:
        ProcessGroups.build(sp_size=3)
    except LayoutError as e:
        out["bad"] = str(e)
    return out


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(_four_rank_scenarios, world_size=4, timeout=90, collective_timeout=20)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [1, 2, 4])
def test_process_groups_on_four_ranks(four_ranks, sp):
    layout = ParallelLayout(4, sp)
    for rank, res in enumerate(four_ranks):
        got, (dp_rank, sp_rank) = res[sp], layout.coords(rank)
        sp_ranks, dp_ranks = layout.sp_group_ranks(dp_rank), layout.dp_group_ranks(sp_rank)
        assert got["ranks"]["get_sequence_parallel_group"] == sp_ranks
        assert got["ranks"]["get_data_parallel_group"] == dp_ranks == got["dp_ranks_method"]
        assert got["ranks"]["get_sequence_data_parallel_group"] == [0, 1, 2, 3]
        for name in _MPU_GROUPS[3:]:
            assert got["ranks"][name] == [rank]
        assert got["ints"] == {
            "get_data_parallel_world_size": 4 // sp, "get_data_parallel_rank": dp_rank,
            "get_sequence_parallel_world_size": sp, "get_sequence_parallel_rank": sp_rank,
            "get_sequence_data_parallel_world_size": 4, "get_sequence_data_parallel_rank": rank,
            "get_model_parallel_world_size": 1, "get_model_parallel_rank": 0,
            "get_tensor_model_parallel_world_size": 1, "get_tensor_model_parallel_rank": 0,
            "get_pipeline_model_parallel_world_size": 1, "get_pipeline_model_parallel_rank": 0,
            "get_tensor_model_parallel_src_rank": rank}
        assert got["sp_group_sum"] == sum(sp_ranks) and got["dp_group_sum"] == sum(dp_ranks)
        assert not got["has_initialize_sequence_parallel"]  # else DeepSpeed ignores the DP methods
        if sp > 1:
            assert got["golden"] <= 1e-10


@pytest.mark.slow
def test_build_rejects_bad_sp_on_live_world(four_ranks):
    assert all("world_size=4 is not divisible by sp_size=3" in res["bad"] for res in four_ranks)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [1, 2, 4])
def test_groups_are_megatron_parallel_state_groups(four_ranks, sp):
    """SP = megatron's context-parallel group, DP = its data-parallel group, DP x SP = its
    DP-with-CP group."""
    layout = ParallelLayout(4, sp)
    for rank, res in enumerate(four_ranks):
        got, (dp_rank, sp_rank) = res[sp]["megatron"], layout.coords(rank)
        assert got["same"] == {"sp": True, "dp": True, "sdp": True, "self": True}
        ranks = res[sp]["ranks"]  # what ProcessGroups' own groups hold
        assert (got["cp_global_ranks"] == layout.sp_group_ranks(dp_rank)
                == ranks["get_sequence_parallel_group"])
        assert got["dp_ranks"] == layout.dp_group_ranks(sp_rank) == ranks["get_data_parallel_group"]
        assert got["cp"] == (sp, sp_rank) and got["dp"] == (4 // sp, dp_rank)


@pytest.mark.slow
def test_repeated_builds_reuse_or_replace_megatron_state(four_ranks):
    for rank, res in enumerate(four_ranks):
        m = res["megatron"]
        assert m["same_layout_reused"]
        assert m["sp4"]["same"] == {"sp": True, "dp": True, "sdp": True, "self": True}
        assert m["sp4"]["cp_global_ranks"] == [0, 1, 2, 3]
        assert not any(m["sp2_after_sp4"]["same"].values())  # megatron holds the sp=4 groups now
        assert m["old_sp_sum"] == sum(ParallelLayout(4, 2).sp_group_ranks(rank // 2))
        assert m["cp_size_after_bad"] == 4
        assert ("initialised by other code" in m["foreign"]
                and "destroy_model_parallel" in m["foreign"])


@pytest.mark.slow
def test_megatron_import_is_quiet_and_leaves_the_weights_only_allowlist(four_ranks):
    for res in four_ranks:
        m = res["megatron"]
        assert not m["imported_before"]  # else the import below was not ProcessGroups.build's
        # the four UserWarnings megatron.core's import gives without Transformer Engine and Apex
        assert (not [msg for cat, msg in m["warnings"] if cat == "UserWarning"
                     and msg.startswith("Transformer Engine and Apex are not installed")])
        # safe_load.py's allowlist stays tensors + DeepSpeed types
        assert m["megatron_safe_globals"] == []
