"""A checkpoint save that cannot fit, or whose write fails, stops with one clear error and leaves
the previous checkpoint usable (a real DeepSpeed engine on 2 gloo ranks; the disk is made to look
full)."""

import errno
import os

from distributed import run_distributed


def _scenario(root):
    import shutil

    import torch
    from torch import nn

    from halo_dist.parallel import ProcessGroups
    from halo_dist.parallel.deepspeed_setup import initialize_engine
    from halo_dist.train import checkpoint as ckpt

    groups = ProcessGroups.build(sp_size=1)
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}
    engine, *_ = initialize_engine(model, config, groups)
    manager = ckpt.CheckpointManager(root, keep_last=2)
    first = manager.save(engine, 1, {"step": 1}, "config: {}\n")
    size = ckpt.folder_bytes(first)
    out = {"expected": ckpt.expected_bytes(manager.root, engine), "size": size}

    real_usage = shutil.disk_usage
    rank = torch.distributed.get_rank()
    # rank 1's disk looks nearly full: both ranks must refuse together (no hang), nothing written
    ckpt.shutil.disk_usage = lambda p: real_usage(p)._replace(
        free=size // 2 if rank == 1 else real_usage(p).free)
    try:
        manager.save(engine, 2, {"step": 2}, "config: {}\n")
    except ckpt.CheckpointWriteError as e:
        out["space"] = str(e)
    ckpt.shutil.disk_usage = real_usage

    def full_disk(*a, **k):  # the write itself fails half-way, as on ENOSPC
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    engine.save_checkpoint = full_disk
    try:
        manager.save(engine, 3, {"step": 3}, "config: {}\n")
    except ckpt.CheckpointWriteError as e:
        out["write"] = str(e)
    out["complete"] = [p.name for p in ckpt.complete_checkpoints(root)]
    out["folders"] = sorted(p.name for p in manager.root.glob("step-*"))
    return out


def test_a_save_that_cannot_fit_or_fails_stops_cleanly_and_keeps_the_previous_checkpoint(tmp_path):
    results = run_distributed(_scenario, world_size=2, args=(str(tmp_path / "ckpt"),), timeout=240)
    for rank, out in enumerate(results):
        assert out["expected"] == out["size"], out  # measured from the previous checkpoint
        assert "not enough space" in out.get("space", ""), (rank, out)
        assert "the previous checkpoint" in out["space"] and "step-00000001" in out["space"]
        assert ("No space left on device" in out["write"]
                and "step-00000001 is intact" in out["write"]), out
        assert out["complete"] == ["step-00000001"]
    assert results[0]["folders"] == ["step-00000001"]  # the failed attempts left nothing behind
