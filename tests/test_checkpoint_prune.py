"""Pruning old checkpoints: the COMPLETE marker goes first, so a deletion cut short never leaves a
folder that resume would take for a complete checkpoint."""

import shutil

import pytest

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
        manager._prune()
    # step 10's files are all still there, yet it is no longer a checkpoint resume could pick
    assert (tmp_path / "step-00000010" / "global_step" / "mp_rank_00_model_states.pt").exists()
    assert ([p.name for p in ckpt.complete_checkpoints(tmp_path)]
            == ["step-00000020", "step-00000030"])

    monkeypatch.setattr(ckpt.shutil, "rmtree", real_rmtree)
    _checkpoint(tmp_path, 40)
    manager._prune()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000030", "step-00000040"]
