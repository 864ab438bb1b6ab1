"""Checkpoint saves and the choice of the checkpoint to resume, on a real DeepSpeed ZeRO-1 engine on
2 gloo ranks (one launch, several scenarios; each test reads its part):

- a save that cannot fit, or whose write fails on one rank (a full disk while DeepSpeed writes rank
  1's shard, rank 0's copy of DeepSpeed's recovery script), stops every rank with the same error and
  leaves the previous checkpoint complete, its partial folder removed;
- saving a step again (a stop signal right after the periodic save; a finished run started again)
  changes nothing, even when that save is killed;
- resume takes the newest checkpoint whose files verify, names the ones it skips, and a save of a
  skipped step replaces it; pruning never deletes the new checkpoint.
"""

import errno
import json
import os

import pytest
from distributed import run_distributed

CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
          "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}


class Killed(BaseException):
    """The process dies here (SIGKILL after Slurm's KillWait), as far as the save can tell."""


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _attempt(fn, *catch):
    """``fn()``'s outcome: ``"ok"``, or the caught exception's type name and message."""
    try:
        fn()
        return "ok"
    except catch as e:  # noqa: PERF203
        return f"{type(e).__name__}: {e}"


def _names(paths):
    return [p.name for p in paths]


def _write_failures(engine, root, rank, out):
    """The space refusal and failed writes on one rank; step 1 is the previous checkpoint."""
    import shutil

    import deepspeed.runtime.engine as ds_engine
    import torch

    from halo_dist.train import checkpoint as ckpt

    m = ckpt.CheckpointManager(root, keep_last=2)
    first = m.save(engine, 1, {"step": 1, "world_size": 2}, "config: {}\n")
    out["manifest"] = json.loads((first / ckpt.MARKER).read_text())["files"]
    size = ckpt.folder_bytes(first)
    out["expected"], out["size"] = ckpt.expected_bytes(root, engine), size
    real_usage = shutil.disk_usage
    # rank 1's disk looks nearly full: both ranks must refuse together (no hang), nothing written
    ckpt.shutil.disk_usage = lambda p: real_usage(p)._replace(
        free=size // 2 if rank == 1 else real_usage(p).free)
    out["space"] = _attempt(lambda: m.save(engine, 2, {"step": 2}, ""), ckpt.CheckpointWriteError)
    ckpt.shutil.disk_usage = real_usage

    real_save, real_copy = torch.save, ds_engine.copyfile

    def full_disk(obj, f, *args, **kwargs):  # a few bytes land, then the disk is full
        (f if hasattr(f, "write") else open(f, "wb")).write(b"\0" * 100)
        _enospc()

    if rank == 1:
        torch.save = full_disk
    out["rank1_full"] = _attempt(lambda: m.save(engine, 2, {"step": 2}, ""),
                                 ckpt.CheckpointWriteError)
    torch.save = real_save
    if rank == 0:
        ds_engine.copyfile = _enospc
    out["rank0_script"] = _attempt(lambda: m.save(engine, 2, {"step": 2}, ""),
                                   ckpt.CheckpointWriteError)
    ds_engine.copyfile = real_copy
    out["after_failures"] = sorted(p.name for p in root.iterdir() if p.is_dir())
    out["first_verifies"] = ckpt.verify(first, rank, 2)
    return first


def _repeated_saves(engine, root, first, out):
    """Step 1 saved again and killed; then a kill half-way through a new save."""
    from halo_dist.train import checkpoint as ckpt

    real_save = engine.save_checkpoint

    def killed(*args, **kwargs):
        raise Killed

    m = ckpt.CheckpointManager(root, keep_last=1)
    m.save(engine, 1, {"step": 1, "world_size": 2}, "")  # this manager's own save of step 1
    marker = first / ckpt.MARKER
    stamp = (marker.stat().st_ino, marker.stat().st_mtime_ns)
    engine.save_checkpoint = killed
    out["stop_after_save"] = _attempt(lambda: m.save(engine, 1, {"step": 1}, ""), Killed)
    rerun = ckpt.CheckpointManager(root, keep_last=1)  # the finished run started again
    engine.save_checkpoint = real_save
    rerun.load(engine, first)
    engine.save_checkpoint = killed
    out["rerun_save"] = _attempt(lambda: rerun.save(engine, 1, {"step": 1}, ""), Killed)
    out["after_repeats"] = _names(ckpt.complete_checkpoints(root))

    def killed_after_writing(*args, **kwargs):
        real_save(*args, **kwargs)
        raise Killed

    engine.save_checkpoint = killed_after_writing
    out["killed_new"] = _attempt(lambda: m.save(engine, 2, {"step": 2}, ""), Killed)
    engine.save_checkpoint = real_save
    out["after_kill"] = _names(ckpt.complete_checkpoints(root))
    out["stamp_kept"] = stamp == (marker.stat().st_ino, marker.stat().st_mtime_ns)


def _damaged(engine, root, rank, out):
    """Steps 2-4 saved; 4 truncated on rank 1, 3 without rank 1's RNG file: resume takes 2."""
    import contextlib
    import io

    import torch.distributed as dist

    from halo_dist.errors import HaloUserError
    from halo_dist.train import checkpoint as ckpt

    m = ckpt.CheckpointManager(root, keep_last=3)
    for step in (2, 3, 4):
        m.save(engine, step, {"step": step, "world_size": 2}, "")
    out["saved"] = _names(ckpt.complete_checkpoints(root))
    if rank == 0:
        shard = root / "step-00000004" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        shard.write_bytes(shard.read_bytes()[:100])
        ckpt.rank_file(root / "step-00000003", 1).unlink()
    dist.barrier()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        chosen = ckpt.find_resume(root, "auto", rank, 2, announce=rank == 0)
    out["chosen"], out["printed"] = chosen.name, printed.getvalue()
    resumed = ckpt.CheckpointManager(root, keep_last=1)
    resumed.load(engine, chosen)
    resumed.save(engine, 3, {"step": 3, "world_size": 2}, "")  # replaces the damaged step 3
    out["after_resave"] = _names(ckpt.complete_checkpoints(root))
    out["verify3"] = ckpt.verify(root / "step-00000003", rank, 2)
    out["verify4"] = ckpt.verify(root / "step-00000004", rank, 2)
    out["never"] = _attempt(lambda: ckpt.find_resume(root, "never", rank, 2), HaloUserError)
    if rank == 0:
        (root / "step-00000003" / "mp_rank_00_model_states.pt").unlink()
    dist.barrier()
    out["none_verifies"] = _attempt(lambda: ckpt.find_resume(root, "auto", rank, 2, False),
                                    HaloUserError)


def _scenario(root):
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch import nn

    from halo_dist.parallel import ProcessGroups
    from halo_dist.parallel.deepspeed_setup import initialize_engine

    groups = ProcessGroups.build(sp_size=1)
    torch.manual_seed(0)
    engine, *_ = initialize_engine(nn.Linear(16, 16), CONFIG, groups)
    root, rank, out = Path(root), dist.get_rank(), {}
    first = _write_failures(engine, root, rank, out)
    _repeated_saves(engine, root, first, out)
    _damaged(engine, root, rank, out)
    return out


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    root = tmp_path_factory.mktemp("saves") / "ckpt"
    return run_distributed(_scenario, world_size=2, args=(str(root),), timeout=300,
                           collective_timeout=20)


@pytest.mark.slow
def test_a_save_that_cannot_fit_or_fails_on_one_rank_stops_every_rank_and_keeps_the_previous(saves):
    for rank, out in enumerate(saves):
        assert out["expected"] == out["size"], out  # measured from the previous checkpoint
        space = out["space"]
        assert "not enough space" in space and "step-00000001 is intact" in space, (rank, space)
        # the failing rank's file and cause, on every rank
        full = out["rank1_full"]
        assert ("CheckpointWriteError" in full and "rank 1" in full
                and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in full
                and "No space left on device" in full and "free on" in full
                and "partial checkpoint was removed" in full
                and "step-00000001 is intact" in full), (rank, full)
        script = out["rank0_script"]
        assert "rank 0" in script and "zero_to_fp32.py" in script, (rank, script)
        assert "No space left on device" in script
        assert out["first_verifies"] == []
    # the failed attempts left nothing behind
    assert saves[0]["after_failures"] == ["step-00000001"]


def test_the_manifest_records_every_ranks_files(saves):
    files = saves[0]["manifest"]
    by_rank = {name: entry["rank"] for name, entry in files.items()}
    assert by_rank["rng_rank00000.pt"] == 0 and by_rank["rng_rank00001.pt"] == 1
    assert by_rank["zero_pp_rank_1_mp_rank_00_optim_states.pt"] == 1
    assert by_rank["mp_rank_00_model_states.pt"] == 0 and "trainer_state.json" in files
    assert all(e["size"] > 0 and len(e["xxh3_128"]) == 32 for e in files.values())


def test_saving_a_step_again_is_a_no_op_and_a_killed_save_keeps_the_newest(saves):
    for out in saves:
        assert out["stop_after_save"] == "ok" and out["rerun_save"] == "ok", out
        assert out["after_repeats"] == ["step-00000001"]
        assert out["killed_new"].startswith("Killed")
        assert out["after_kill"] == ["step-00000001"] and out["stamp_kept"]


def test_resume_takes_the_newest_checkpoint_that_verifies_and_names_the_skipped(saves):
    for rank, out in enumerate(saves):
        assert out["saved"] == ["step-00000002", "step-00000003", "step-00000004"]
        assert out["chosen"] == "step-00000002", out
        # the resumed run's save of step 3 replaced the damaged one; pruning kept the newer 4 (a
        # resume skipped it) and dropped 2
        assert out["after_resave"] == ["step-00000003", "step-00000004"]
        assert out["verify3"] == [] and out["verify4"], out
        assert "checkpoint.resume=never" in out["never"] and "Move them away" in out["never"]
        none = out["none_verifies"]
        assert ("DamagedCheckpointError" in none and "step-00000004: rank 1's "
                "zero_pp_rank_1_mp_rank_00_optim_states.pt has 100 bytes" in none
                and "step-00000003: rank 0's mp_rank_00_model_states.pt is missing" in none), none
    printed = saves[0]["printed"]
    assert "skipping checkpoint" in printed and "step-00000004: rank 1's" in printed, printed
    assert "step-00000003: rank 1's rng_rank00001.pt is missing" in printed, printed
    assert saves[1]["printed"] == ""

