"""Remote code runs only where the user asked for it: folders halo_dist exported are recognised by
the content of their files; any other folder that carries code (a .py, an auto_map) is refused
without --trust-remote-code, before transformers could import it; an export never carries foreign
code."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_qwen3

from halo_dist.eval.tokenizers import BYTE_VOCAB, byte_tokenizer
from halo_dist.models.convert import convert_model
from halo_dist.models.export import export_hypenet
from halo_dist.models.trust import UntrustedCodeError, carried_code, is_halo_folder, trust_for

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trust") / "hypenet"
    export_hypenet(convert_model(tiny_qwen3(vocab=BYTE_VOCAB), [0]), folder,
                   tokenizer=byte_tokenizer())
    return folder


def _planted(folder: Path, marker: Path) -> Path:
    """A tokenizer whose auto_map points at its own module, which would leave ``marker`` when
    imported."""
    (folder / "evil_tokenizer.py").write_text("import pathlib\n"
                                              f"pathlib.Path({str(marker)!r}).write_text('ran')\n")
    config = folder / "tokenizer_config.json"
    data = json.loads(config.read_text()) if config.exists() else {}
    data["auto_map"] = {"AutoTokenizer": ["evil_tokenizer.EvilTokenizer", None]}
    config.write_text(json.dumps(data))
    return folder


def test_our_export_is_trusted_by_content_and_a_changed_file_is_not(export, tmp_path):
    assert is_halo_folder(export) and trust_for(export) is True
    changed = tmp_path / "changed"
    shutil.copytree(export, changed)
    with open(changed / "modeling_hypenet.py", "a") as f:
        f.write("\n# edited\n")
    assert not is_halo_folder(changed)
    with pytest.raises(UntrustedCodeError, match="modeling_hypenet.py"):
        trust_for(changed)
    assert trust_for(changed, explicit=True) is True


def test_a_plain_folder_needs_no_trust_and_a_planted_one_is_refused(smollm2_dir, tmp_path):
    assert carried_code(smollm2_dir) == [] and trust_for(smollm2_dir) is False
    # a hub id: transformers' own default (no remote code)
    assert trust_for("Qwen/Qwen3-1.7B") is False
    planted = _planted(Path(shutil.copytree(smollm2_dir, tmp_path / "teacher")), tmp_path / "RAN")
    with pytest.raises(UntrustedCodeError,
                       match="evil_tokenizer.py, tokenizer_config.json auto_map"):
        trust_for(planted)


@pytest.mark.slow
def test_commands_refuse_a_planted_folder_before_running_its_code(smollm2_dir, tmp_path):
    marker = tmp_path / "RAN"
    planted = _planted(Path(shutil.copytree(smollm2_dir, tmp_path / "teacher")), marker)
    for cmd in (["generate", "--model", str(planted), "--prompt", "Hi", "--max-new-tokens", "1"],
                ["eval-suite", "--model", str(planted), "--output-dir", str(tmp_path / "out"),
                 "--niah-lengths", "96", "--csr-tasks", ""]):
        res = subprocess.run([sys.executable, "-m", "halo_dist.cli", *cmd], capture_output=True,
                             text=True, cwd=REPO, timeout=300)
        assert (res.returncode == 2
                and "carries code that halo_dist did not write" in res.stderr), res.stderr[-1500:]
        assert "--trust-remote-code" in res.stderr and "Traceback" not in res.stderr
    assert not marker.exists()


def test_an_export_drops_code_a_tokenizer_brought_along(tmp_path):
    from halo_dist.models.export import _drop_foreign_code

    folder = tmp_path / "out"
    folder.mkdir()
    _planted(folder, tmp_path / "RAN")
    (folder / "modeling_hypenet.py").write_text("ours")
    _drop_foreign_code(folder)
    assert sorted(p.name for p in folder.glob("*.py")) == ["modeling_hypenet.py"]
    assert "auto_map" not in json.loads((folder / "tokenizer_config.json").read_text())


def test_export_refuses_a_teacher_with_foreign_code_before_reading_the_shards(tmp_path,
                                                                             monkeypatch):
    """`halo-dist export` of a stage-2 checkpoint reads the run's tokenizer (and so refuses a
    teacher folder that carries code) before it consolidates the shards, which takes minutes at
    scale."""
    from halo_dist.train import export_checkpoint as ex

    ckpt = tmp_path / "checkpoints" / "step-00000001"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"stage": "stage2", "step": 1,
                                                         "student_config": {}}))
    monkeypatch.setattr(ex, "resolve_checkpoint", lambda path: ckpt)

    def refuse(_):
        raise UntrustedCodeError("teacher folder carries modeling_evil.py")

    def consolidate(_):
        raise AssertionError("the shards were read before the teacher was checked")

    monkeypatch.setattr(ex, "run_tokenizer", refuse)
    monkeypatch.setattr(ex, "consolidated_state", consolidate)
    with pytest.raises(UntrustedCodeError, match="modeling_evil"):
        ex.export_checkpoint(ckpt, tmp_path / "out")
