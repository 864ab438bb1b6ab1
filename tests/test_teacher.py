"""The teacher module: its file digests are computed once, reused while a file's size and mtime are
unchanged, recomputed when it changes, and the comparison names what changed; importing it (as the
Slurm driver does for the depth check) does not import torch."""

import os
import subprocess
import sys

import pytest

from halo_dist.config import ConfigError
from halo_dist.data import shards
from halo_dist.teacher import check_same_teacher, teacher_digests


def test_digests_are_cached_by_stat_and_recomputed_when_a_file_changes(tmp_path, monkeypatch):
    folder, cache = tmp_path / "teacher", tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"a" * 1000)
    first = teacher_digests(folder, cache)
    assert set(first) == {"config.json", "model.safetensors"}

    def no_hashing(path):
        raise AssertionError(f"{path} was hashed again")

    monkeypatch.setattr(shards, "sha256_file", no_hashing)
    assert teacher_digests(folder, cache) == first  # nothing read
    monkeypatch.undo()
    (folder / "model.safetensors").write_bytes(b"b" * 1000)  # same size, new content and mtime
    os.utime(folder / "model.safetensors", ns=(1, 1))
    second = teacher_digests(folder, cache)
    assert (second["config.json"] == first["config.json"]
            and second["model.safetensors"] != first["model.safetensors"])
    with pytest.raises(ConfigError, match="model.safetensors") as e:
        check_same_teacher(first, second, tmp_path / "step-00000002")
    assert "config.json" not in str(e.value)
    check_same_teacher(first, first, tmp_path)
    check_same_teacher(None, second, tmp_path)  # a checkpoint from before digests were recorded


def test_the_depth_check_imports_no_torch():
    code = ("import sys; from halo_dist.teacher import teacher_depth_problem; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
