"""ParallelLayout arithmetic (no processes) and ProcessGroups on 4 gloo ranks (one launch)."""

from __future__ import annotations

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

_MPU_INTS = ["get_data_parallel_world_size", "get_data_parallel_rank", "get_sequence_parallel_world_size",
             "get_sequence_parallel_rank", "get_sequence_data_parallel_world_size",
             "get_sequence_data_parallel_rank", "get_model_parallel_world_size", "get_model_parallel_rank",
             "get_tensor_model_parallel_world_size", "get_tensor_model_parallel_rank",
             "get_pipeline_model_parallel_world_size", "get_pipeline_model_parallel_rank",
             "get_tensor_model_parallel_src_rank"]
_MPU_GROUPS = ["get_data_parallel_group", "get_sequence_parallel_group", "get_sequence_data_parallel_group",
               "get_model_parallel_group", "get_tensor_model_parallel_group", "get_pipeline_model_parallel_group"]


def _describe(groups: ProcessGroups) -> dict:
    """Everything the parent checks about one rank's groups, including live collectives."""
    res = {"ints": {name: getattr(groups, name)() for name in _MPU_INTS},
           "ranks": {name: dist.get_process_group_ranks(getattr(groups, name)()) for name in _MPU_GROUPS},
           "dp_ranks_method": groups.get_data_parallel_group_ranks(),
           "has_initialize_sequence_parallel": hasattr(groups, "initialize_sequence_parallel")}
    for name in ("sp_group", "dp_group"):
        t = torch.tensor([float(groups.rank)])
        dist.all_reduce(t, group=getattr(groups, name))
        res[f"{name}_sum"] = t.item()
    return res


def _four_rank_scenarios() -> dict:
    out = {}
    for sp in (1, 2, 4):
        groups = ProcessGroups.build(sp_size=sp)
        out[sp] = _describe(groups)
        if sp > 1:  # Ulysses inside an SP group that is not the world; replicas get different data
            sp_ctx = SequenceParallel(groups.sp_group)
            out[sp]["golden"] = max(max(attention_golden(sp_ctx, 8, kv, seed=100 * groups.dp_rank + kv).values())
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
