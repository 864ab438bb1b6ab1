"""DeepSpeed on CPU (gloo, 2 ranks) with ProcessGroups as its mpu: ``deepspeed.initialize`` accepts
it, and two AdamW steps (with active gradient clipping) of a toy Ulysses attention block under
ZeRO-3 with sp=1 (dp=2) and sp=2 (dp=1), and ZeRO-2 with sp=2, equal a single-process run on the
full batch and sequence -- losses, gradient norms and weights (one launch for all layouts). bf16
ZeRO-1/2 built by ``initialize_engine`` checks overflow through the gradient norm alone and still
matches DeepSpeed's own engine step for step."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from halo_dist.parallel import ParallelLayout, ProcessGroups, SequenceParallel
from distributed import run_distributed
from ulysses_golden import attention
from sp_testing import shard_seq

REPO = Path(__file__).resolve().parents[1]

BATCH, SEQ, DIM, HEADS, STEPS, LR = 2, 8, 8, 2, 2, 1e-2
CLIP = 0.05  # active, so DeepSpeed's gradient norm over the layout matters
LAYOUTS = [(1, 3), (2, 3), (2, 2)]  # (sp, ZeRO stage) on 2 ranks


class ToyAttentionBlock(nn.Module):
    """x [B, T/sp, C] -> [B, T/sp, C]: qkv projection, Ulysses causal attention, output
    projection."""

    def __init__(self, sp: SequenceParallel):
        super().__init__()
        self.sp = sp
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x):
        b, t_local, _ = x.shape
        # 3 x [B, T/sp, H, D]
        q, k, v = self.qkv(x).view(b, t_local, 3, HEADS, DIM // HEADS).unbind(2)
        # [B, T, H/sp, D]
        o = attention(self.sp.seq_to_head(q), self.sp.seq_to_head(k), self.sp.seq_to_head(v))
        # [B, T/sp, H, D] -> [B, T/sp, C]
        return self.out(self.sp.head_to_seq(o).reshape(b, t_local, DIM))


def _loss(y: torch.Tensor, replica_tokens: int) -> torch.Tensor:
    """This rank's share of its replica's mean-over-tokens loss (DeepSpeed sums it over SP ranks
    and averages over DP ranks)."""
    return (y.float() ** 2).sum() / replica_tokens


def _data():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(BATCH, SEQ, DIM, generator=gen) for _ in range(STEPS)]


def _reference(model: nn.Module) -> tuple[list[float], list[float], dict]:
    """Single-process AdamW steps on the full batch and sequence: losses, grad norms, weights."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, norms = [], []
    for x in _data():
        loss = _loss(model(x), BATCH * SEQ)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ds_config(dp: int, stage: int = 3) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH // dp, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW",
                          "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "gradient_clipping": CLIP, "steps_per_print": 10**9, "wall_clock_breakdown": False}


def _build(sp_size: int):
    """ProcessGroups, the SP model and its single-process reference run (same initial weights)."""
    groups = ProcessGroups.build(sp_size=sp_size)
    torch.manual_seed(0)
    reference = ToyAttentionBlock(SequenceParallel(None))  # full sequence, no SP
    model = ToyAttentionBlock(SequenceParallel(groups.sp_group))
    model.load_state_dict(reference.state_dict())
    return groups, model, _reference(reference)


def _train(engine, groups: ProcessGroups, loss_factor: int) -> tuple[list[float], list[float]]:
    """STEPS DeepSpeed steps, each rank on its [B/dp, T/sp] block; returns global losses, grad
    norms."""
    dp, sp = groups.layout.dp_size, SequenceParallel(groups.sp_group)
    losses, norms = [], []
    for x in _data():
        x = shard_seq(sp, x.chunk(dp)[groups.dp_rank])  # [B/dp, T/sp, C]: this rank's block
        loss = _loss(engine(x), BATCH // dp * SEQ)  # this rank's share of its replica's loss
        engine.backward(loss * loss_factor)
        engine.step()
        norms.append(float(engine.get_global_grad_norm()))
        total = loss.detach().clone()
        dist.all_reduce(total)  # sum over ranks = sum over replicas of their mean loss
        losses.append(total.item() / dp)
    return losses, norms


def _run_layout(sp_size: int, stage: int) -> dict:
    """Train with ProcessGroups(sp_size) as mpu under ZeRO `stage`; compare with the reference."""
    import deepspeed

    from halo_dist.parallel.deepspeed_setup import initialize_engine, sp_loss_factor

    groups, model, (ref_losses, ref_norms, ref_state) = _build(sp_size)
    config = _ds_config(groups.layout.dp_size, stage)
    engine, *_ = initialize_engine(model, config, groups)
    losses, norms = _train(engine, groups, sp_loss_factor(config, groups))
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=stage == 3):
        err = max((p.detach() - ref_state[n]).abs().max().item() for n, p in params.items())
    facts = {"dp_world_size": engine.dp_world_size, "seq_dp_world_size": engine.seq_dp_world_size,
             "sequence_parallel_size": engine.sequence_parallel_size}
    if stage == 3:
        facts["partition_sizes"] = sorted({dist.get_world_size(p.ds_process_group)
                                           for p in params.values()})
        facts["partitioned"] = all(p.ds_tensor.numel() < p.ds_numel for p in params.values())
    return {"losses": losses, "ref_losses": ref_losses, "norms": norms, "ref_norms": ref_norms,
            "param_err": err, **facts}


def _wrong_partition_error() -> str:
    """A model pre-partitioned over the pure DP group (size 1 at sp=2) must be refused."""
    import deepspeed

    from halo_dist.parallel.deepspeed_setup import initialize_engine

    groups = ProcessGroups.build(sp_size=2)
    model = ToyAttentionBlock(SequenceParallel(groups.sp_group))
    deepspeed.zero.Init(module=model, data_parallel_group=groups.get_data_parallel_group())
    try:
        initialize_engine(model, _ds_config(dp=1), groups)
    except RuntimeError as e:
        return str(e)
    return "no error"


def _both_layouts() -> dict:
    from halo_dist.parallel.deepspeed_setup import init_distributed

    init_distributed(cpu=True)
    out = {layout: _run_layout(*layout) for layout in LAYOUTS}
    out["wrong_partition"] = _wrong_partition_error()
    return out


@pytest.fixture(scope="module")
def zero_runs():
    return run_distributed(_both_layouts, world_size=2, timeout=150, collective_timeout=60,
                           env={"DS_ACCELERATOR": "cpu"})


@pytest.mark.slow
@pytest.mark.parametrize("sp,stage", LAYOUTS)
def test_zero_with_mpu_matches_single_process(zero_runs, sp, stage):
    for res in zero_runs:
        run = res[(sp, stage)]
        assert run["dp_world_size"] == 2 // sp and run["sequence_parallel_size"] == sp
        assert run["seq_dp_world_size"] == 2
        if stage == 3:
            assert run["partition_sizes"] == [2] and run["partitioned"]
        assert run["losses"] == pytest.approx(run["ref_losses"], rel=1e-5, abs=1e-7)
        assert run["ref_losses"][1] != run["ref_losses"][0]  # the first step changed the weights
        # not double-counted over SP
        assert run["norms"] == pytest.approx(run["ref_norms"], rel=1e-5)
        assert run["ref_norms"][0] > CLIP
        assert run["param_err"] <= 1e-5


@pytest.mark.slow
def test_zero3_refuses_parameters_partitioned_over_dp_only(zero_runs):
    for res in zero_runs:
        assert "partitioned over 1 ranks" in res["wrong_partition"]
        assert "get_sequence_data_parallel_group" in res["wrong_partition"]


@pytest.mark.parametrize("stage,sp,factor",
                         [(0, 2, 1), (1, 2, 1), (2, 2, 1), (3, 2, 2), (3, 4, 4), (3, 1, 1)])
def test_sp_loss_factor(stage, sp, factor):
    from halo_dist.parallel.deepspeed_setup import sp_loss_factor

    groups = ProcessGroups(ParallelLayout(4, sp), 0, None, None, None, None)
    assert sp_loss_factor(_ds_config(dp=1, stage=stage), groups) == factor


def test_zero3_sp_refuses_reduce_scatter_false():
    from halo_dist.parallel.deepspeed_setup import sp_loss_factor

    config = _ds_config(dp=1)
    config["zero_optimization"]["reduce_scatter"] = False
    with pytest.raises(ValueError, match="reduce_scatter=true"):
        sp_loss_factor(config, ProcessGroups(ParallelLayout(2, 2), 0, None, None, None, None))


def _bf16_zero_run(stage: int, streamlined: bool, groups: ProcessGroups, calls: list) -> dict:
    """Two finite steps, a step whose loss is NaN (dropped by the trainers' poisoning), a step with
    a finite loss but inf gradients, and a finite step, under bf16 ZeRO ``stage`` on 2 ranks;
    ``streamlined``: built by ``initialize_engine`` (the norm is the overflow check), else by
    DeepSpeed alone."""
    import deepspeed

    from halo_dist.parallel.deepspeed_setup import initialize_engine
    from halo_dist.train.stopping import backward_and_step

    torch.manual_seed(0)
    model = ToyAttentionBlock(SequenceParallel(groups.sp_group)).to(torch.bfloat16)
    config = {**_ds_config(dp=2, stage=stage), "bf16": {"enabled": True}}
    engine = (initialize_engine(model, config, groups)[0] if streamlined else
              deepspeed.initialize(model=model, config=config, mpu=groups)[0])
    calls.clear()
    norms, applied = [], []
    data = (_data() * 3)[:5]
    for i, x in enumerate(data):
        y = engine(x.chunk(2)[groups.dp_rank].to(torch.bfloat16))  # [B/2, T, C]
        if i == 3:  # a finite loss whose gradients are inf
            y.register_hook(lambda g: g * float("inf"))
        backward_and_step(engine, _loss(y, BATCH // 2 * SEQ), drop=i == 2)
        norms.append(float(engine.get_global_grad_norm()))
        applied.append(engine.was_step_applied())
    weights = torch.cat([p.detach().float().flatten() for p in engine.module.parameters()])
    return {"norms": norms, "applied": applied, "weights": weights, "overflow_passes": len(calls)}


def _bf16_zero_both() -> dict:
    """The streamlined engine and DeepSpeed's own under ZeRO-1 and ZeRO-2, counting DeepSpeed's
    per-tensor overflow passes."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from halo_dist.parallel.deepspeed_setup import init_distributed

    init_distributed(cpu=True)
    groups = ProcessGroups.build(sp_size=1)
    calls: list = []
    original = DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial

    def counted(self):
        calls.append(1)
        return original(self)

    DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial = counted
    return {(stage, streamlined): _bf16_zero_run(stage, streamlined, groups, calls)
            for stage in (1, 2) for streamlined in (True, False)}


@pytest.mark.slow
def test_bf16_zero_checks_overflow_through_the_norm_alone():
    """bf16 ZeRO-1 and ZeRO-2 built by ``initialize_engine`` skip DeepSpeed's per-tensor overflow
    pass (one per step on DeepSpeed's own engine) and still drop exactly the steps DeepSpeed drops:
    a NaN loss and inf gradients; their fp32 foreach norm equals DeepSpeed's fp64 one and the
    weights after every step match."""
    for res in run_distributed(_bf16_zero_both, world_size=2, timeout=150, collective_timeout=60,
                               env={"DS_ACCELERATOR": "cpu"}):
        for stage in (1, 2):
            ours, theirs = res[(stage, True)], res[(stage, False)]
            assert theirs["overflow_passes"] == 5 and ours["overflow_passes"] == 0, stage
            assert ours["applied"] == theirs["applied"] == [True, True, False, False, True]
            finite = [0, 1, 4]
            assert [ours["norms"][i] for i in finite] == pytest.approx(
                [theirs["norms"][i] for i in finite], rel=1e-5)
            assert ours["norms"][0] > CLIP  # clipping active: the norm's value matters
            torch.testing.assert_close(ours["weights"], theirs["weights"], rtol=0, atol=0)


@pytest.mark.slow
def test_an_engine_on_a_callers_process_group_builds_no_deepspeed_op(tmp_path):
    """A process group made by the caller (not by init_distributed), then initialize_engine on CPU:
    DeepSpeed's comm backend is created inside deepspeed.initialize and must not JIT-compile its
    shared-memory op (~75 s, behind one file lock that a killed build leaves for every later
    run)."""
    import subprocess
    import sys

    script = f"""
import torch, torch.distributed as dist
from torch import nn
dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
from halo_dist.parallel import ProcessGroups
from halo_dist.parallel.deepspeed_setup import initialize_engine
config = {{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "torch_adam": True}}}},
          "zero_optimization": {{"stage": 1}}}}
initialize_engine(nn.Linear(4, 4), config, ProcessGroups.build(sp_size=1))
"""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29555", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (tmp_path / "ext" / "deepspeed_shm_comm").exists(), proc.stdout[-2000:]
