"""`halo-dist eval-suite`: NIAH, lm-eval CSR and held-out perplexity of one model in one process,
resumable."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from data_fixtures import run_prep

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_eval_suite_writes_every_part_and_skips_them_when_rerun(smollm2_dir, tmp_path):
    data = tmp_path / "data"
    run_prep(data, max_docs=150, shard_tokens=8000, heldout_fraction=0.1,
             tokenizer=str(smollm2_dir))
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "halo_dist.cli", "eval-suite", "--model", str(smollm2_dir),
           "--output-dir", str(out), "--name", "teacher", "--niah-lengths", "160", "--niah-depths",
           "0.5", "--niah-batch-tokens", "200", "--csr-tasks", "arc_easy,winogrande", "--csr-limit",
           "2", "--ppl-data", str(data), "--ppl-seq-len", "128", "--ppl-rows", "2", "--done-marker",
           "--reference-cache", str(tmp_path / "reference")]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    niah = json.loads((out / "niah" / "teacher.json").read_text())
    # 3 tasks x 1 cell
    assert len(niah["records"]) == 3 and (out / "niah" / "teacher_heatmap.png").exists()
    csr = json.loads((out / "csr.json").read_text())
    assert set(csr["tasks"]) == {"arc_easy", "winogrande"} and csr["tasks"]["arc_easy"]["n"] == 2
    # each task's items, standard error and chance level (ARC-Easy: 3-5 choices; WinoGrande: 2)
    arc, wino = csr["tasks"]["arc_easy"], csr["tasks"]["winogrande"]
    assert len(arc["items"]) == 2 and set(arc["items"]) <= {"0", "1"}
    assert arc["acc_norm"] == arc["items"].count("1") / 2 and wino["chance"] == 0.5
    assert 0.2 <= arc["chance"] <= 0.34 and csr["csr_se"] is not None
    ppl = json.loads((out / "ppl.json").read_text())
    # a real 135M model on Wikipedia text: far below the uniform 49,152-way guess (ppl 49,152)
    assert ppl["rows"] == 2 and 1.0 < ppl["ppl"] < 200.0, ppl
    assert ppl["ppl_ci95"][0] < ppl["ppl"] < ppl["ppl_ci95"][1] and len(ppl["row_ce"]) == 2
    assert set(json.loads((out / "DONE").read_text())) == {"niah", "csr", "ppl"}
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert again.returncode == 0 and again.stdout.count("already done") == 3, again.stdout
    # another run of the same model and settings copies the reference figures: no evaluation
    out2 = tmp_path / "eval2"
    cmd[cmd.index(str(out))] = str(out2)
    reused = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert reused.returncode == 0 and reused.stdout.count("reference figures reused") == 3
    assert "done in" not in reused.stdout, reused.stdout
    for part in ("csr.json", "ppl.json", "niah/teacher.json"):
        assert (out2 / part).read_bytes() == (out / part).read_bytes()
    assert (out2 / "niah" / "teacher_heatmap.png").exists()


def test_reference_keys_follow_the_model_files_and_settings(tmp_path):
    from halo_dist.eval.reference import model_identity, part_key

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "README.md").write_text("card")
    first = model_identity(folder)
    (folder / "README.md").write_text("another card")  # the card does not change the model
    assert model_identity(folder) == first
    (folder / "model.safetensors").write_bytes(b"weightz")
    assert model_identity(folder) != first
    key = part_key("csr", first, {"tasks": "piqa", "limit": 0})
    assert key == part_key("csr", first, {"limit": 0, "tasks": "piqa"})
    assert key != part_key("csr", first, {"tasks": "piqa", "limit": 10})
    assert key != part_key("niah", first, {"tasks": "piqa", "limit": 0})


def test_eval_suite_refuses_bad_arguments_before_loading(tmp_path):
    cmd = [sys.executable, "-m", "halo_dist.cli", "eval-suite", "--model", "smollm2",
           "--output-dir", str(tmp_path), "--ppl-data", str(tmp_path / "missing")]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert (res.returncode == 2 and "--ppl-data" in res.stderr
            and "no such" in res.stderr), res.stderr


def test_done_marker_must_be_a_file_name(tmp_path):
    cmd = [sys.executable, "-m", "halo_dist.cli", "eval-suite", "--model", "smollm2",
           "--output-dir", str(tmp_path), "--done-marker", "../elsewhere/DONE"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert (res.returncode == 2 and "--done-marker" in res.stderr
            and "file name" in res.stderr), res.stderr


def test_a_missing_model_is_named_by_its_flag(tmp_path, capsys):
    """``--model X`` that does not exist says ``--model X``, not "teacher path"."""
    from halo_dist.cli import main

    missing = tmp_path / "no_such_model"
    assert main(["eval-suite", "--model", str(missing), "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"--model {missing} does not exist" in err and "teacher" not in err, err
