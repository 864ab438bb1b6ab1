"""Checkpoint folders without an engine: pruning (the COMPLETE marker goes first, so a deletion cut
short never leaves a folder that resume would take for a complete checkpoint; the new checkpoint and
newer ones stay), checkpoints saved before manifests, and per-rank state files that are missing."""

import json
import shutil

import pytest
import torch

from halo_dist.errors import MissingInputError
from halo_dist.train import checkpoint as ckpt


def _checkpoint(root, step):
    path = root / ckpt.step_dir_name(step)
    (path / "global_step").mkdir(parents=True)
    (path / "global_step" / "mp_rank_00_model_states.pt").write_bytes(b"x" * 64)
    (path / ckpt.MARKER).write_text("{}")
    return path


def test_prune_keeps_the_newest_and_a_cut_deletion_leaves_nothing_complete(tmp_path, monkeypatch):
    for step in (10, 20, 30):
        _checkpoint(tmp_path, step)
    manager = ckpt.CheckpointManager(tmp_path, keep_last=2)
    real_rmtree = shutil.rmtree

    def killed_midway(path, ignore_errors=False):  # the process dies before any file is deleted
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        manager._prune(tmp_path / "step-00000030")
    # step 10's files are all still there, yet it is no longer a checkpoint resume could pick
    assert (tmp_path / "step-00000010" / "global_step" / "mp_rank_00_model_states.pt").exists()
    assert ([p.name for p in ckpt.complete_checkpoints(tmp_path)]
            == ["step-00000020", "step-00000030"])

    monkeypatch.setattr(ckpt.shutil, "rmtree", real_rmtree)
    _checkpoint(tmp_path, 40)
    manager._prune(tmp_path / "step-00000040")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000030", "step-00000040"]


def test_pruning_keeps_the_new_checkpoint_and_leaves_newer_ones(tmp_path):
    """keep_last=1 after a resume from step 4 that skipped a damaged step 8: the new step 6 stays,
    and so does step 8 (the run replaces it when it saves step 8 again)."""
    for step in (2, 4, 6, 8):
        _checkpoint(tmp_path, step)
    (tmp_path / "step-00000003").mkdir()  # an incomplete folder
    ckpt.CheckpointManager(tmp_path, keep_last=1)._prune(tmp_path / "step-00000006")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006", "step-00000008"]


def _legacy_checkpoint(root, step, ranks, world=2):
    """A checkpoint as saved before manifests: a marker without the file list."""
    path = root / ckpt.step_dir_name(step)
    path.mkdir()
    (path / ckpt.TRAINER_STATE).write_text(json.dumps({"step": step, "world_size": world}))
    for rank in ranks:
        torch.save(ckpt.rng_state(), ckpt.rank_file(path, rank))
    (path / ckpt.MARKER).write_text(json.dumps({"step": step}))
    return path


def test_a_missing_rank_state_file_is_refused_not_ignored(tmp_path, capsys):
    _legacy_checkpoint(tmp_path, 2, ranks=(0, 1))
    newest = _legacy_checkpoint(tmp_path, 4, ranks=(0,))
    assert ckpt.find_resume(tmp_path, "auto") == tmp_path / "step-00000002"
    out = capsys.readouterr().out
    assert f"skipping checkpoint {newest}: rank 1's rng_rank00001.pt is missing" in out, out
    assert "step-00000002 was saved without a manifest" in out
    # loading it anyway stops, naming the file; a rank the checkpoint did not have starts seeded
    with pytest.raises(MissingInputError, match="rng_rank00001.pt is missing.*written on 2"):
        ckpt.load_rank_state(newest, 1)
    assert ckpt.load_rank_state(newest, 2) is None
    assert ckpt.load_rank_state(newest, 0)["torch"].dtype == torch.uint8


def test_resume_never_refuses_a_folder_that_holds_checkpoints(tmp_path):
    """A new run among an earlier run's checkpoints would prune against them, and a later automatic
    resume would continue whichever is newest: refused, nothing deleted."""
    assert ckpt.find_resume(tmp_path / "absent", "never") is None
    _checkpoint(tmp_path, 10)
    with pytest.raises(ckpt.IncompatibleInputError, match="resume=never.*step-00000010.*Move them"):
        ckpt.find_resume(tmp_path, "never")
    assert ckpt.complete_checkpoints(tmp_path) == [tmp_path / "step-00000010"]


def test_a_failed_write_inside_torch_save_is_recorded_with_its_file_and_cause(tmp_path):
    """A real write failure (the kernel refuses bytes past a file-size limit, as a full disk refuses
    them): torch's own path writer reports it as ``RuntimeError('unexpected pos')``; a checkpoint
    write goes through a Python file, so the error keeps its errno and is recorded, not raised
    (the ranks agree on it afterwards)."""
    import resource
    import signal

    from halo_dist.train.checkpoint_files import RecordedWrites

    big = {"w": torch.zeros(100_000)}
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, limits[1]))
    try:
        with pytest.raises(RuntimeError, match="unexpected pos"):
            torch.save(big, tmp_path / "plain.pt")
        writes = RecordedWrites(tmp_path, rank=0)
        writes.torch_save(big, tmp_path / "shard.pt")
        writes.text(tmp_path / "after.json", "{}")  # nothing more is written after a failure
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    assert writes.error.startswith(f"{tmp_path / 'shard.pt'}: File too large ("), writes.error
    assert "free on /" in writes.error
    assert writes.entries == {} and not (tmp_path / "after.json").exists()
