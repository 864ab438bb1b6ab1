"""Logits-scaling calibration: grid search by held-out loss, atomic config write, bad
input."""

import json

import pytest
import torch
from conftest import tiny_qwen3

from halo_dist import cli
from halo_dist.eval import calibrate as cal
from halo_dist.eval.errors import EvalError
from halo_dist.eval.tokenizers import BYTE_VOCAB, byte_tokenizer
from halo_dist.models.convert import convert_model
from halo_dist.models.export import export_hypenet


@pytest.fixture(scope="module")
def hypenet_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cal") / "hypenet"
    # attention layers 0 and 2, a = 500
    student = convert_model(tiny_qwen3(vocab=BYTE_VOCAB), [0, 2])
    export_hypenet(student, folder, tokenizer=byte_tokenizer())
    return folder


def test_grid_parsing():
    assert cal.parse_grid("none, 100,300.5") == [None, 100.0, 300.5]
    for bad in ("1", "abc", "-5", ""):
        with pytest.raises(EvalError):
            cal.parse_grid(bad)


def test_heldout_loss_is_the_models_cross_entropy_and_a_is_restored(hypenet_folder):
    model, tok = cal.load_folder(hypenet_folder)
    batches = cal.long_batches("random", tok, 48, 2, 2, model.config.vocab_size)
    ids = batches[0]["input_ids"]
    with torch.no_grad():
        expected = model(ids, labels=ids).loss.item()
    # odd chunks: chunking must not matter
    got = cal.heldout_loss(model, batches[:1], chunk_tokens=7)
    assert got["loss"] == pytest.approx(expected, rel=1e-5) and got["tokens"] == 2 * 47
    curve = cal.grid_search(model, batches, [None, 2.0, 1000.0], log=lambda m: None)
    assert model.config.attn_logits_scale_base == 500.0
    # a changes the function of the attention layers
    assert len({round(p["loss"], 6) for p in curve}) == 3
    assert "*" in cal.format_curve(curve)


def test_cli_writes_the_best_a_into_config(hypenet_folder, tmp_path, capsys):
    args = ["calibrate-scaling", "--model", str(hypenet_folder), "--data", "wiki", "--seq-len",
            "64", "--rows", "2", "--batch-size", "2", "--grid", "none,2,20,1000", "--output",
            str(tmp_path / "curve.json")]
    assert cli.main(args + ["--dry-run"]) == 0
    assert (json.loads((hypenet_folder / "config.json").read_text())["attn_logits_scale_base"]
            == 500.0)
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "curve.json").read_text())
    lowest = min(report["curve"], key=lambda p: p["loss"])["a"]
    # the model was trained at a = 500, which the grid lacks: no scaling is the reference
    best = lowest if report["gain"] and report["why"].endswith("outside the noise") else None
    assert report["chosen_a"] == best and report["lowest_loss_a"] == lowest
    assert (json.loads((hypenet_folder / "config.json").read_text())["attn_logits_scale_base"]
            == best)
    assert all(f"{'none' if p['a'] is None else format(p['a'], 'g'):>6} |" in printed
               for p in report["curve"])
    model, _ = cal.load_folder(hypenet_folder)  # the folder still loads, with the new a
    assert model.config.attn_logits_scale_base == best
    assert not list(hypenet_folder.glob(".config.json.*"))  # no temp files left


def test_bad_models_are_refused(tmp_path, capsys):
    teacher = tmp_path / "teacher"
    tiny_qwen3().save_pretrained(teacher)
    assert cli.main(["calibrate-scaling", "--model", str(teacher), "--data", "random"]) == 2
    assert "only in HypeNet" in capsys.readouterr().err
    rnn_only = tmp_path / "rnn"
    export_hypenet(convert_model(tiny_qwen3(), []), rnn_only)
    assert cli.main(["calibrate-scaling", "--model", str(rnn_only), "--data", "random"]) == 2
    assert "no attention layers" in capsys.readouterr().err
    assert cli.main(["calibrate-scaling", "--model", str(tmp_path / "nope")]) == 2
    assert "not found" in capsys.readouterr().err


def _point(a, rows):
    return {"a": a, "loss": sum(rows) / len(rows), "row_losses": rows, "tail_loss": 0.0,
            "row_tail_losses": rows}


def test_a_base_replaces_the_trained_one_only_when_it_wins_beyond_the_noise():
    trained = _point(500.0, [3.0, 3.2, 2.9, 3.1, 3.0, 3.3])
    # lower on average, but row by row it wins some and loses some: noise
    noisy = _point(200.0, [2.8, 3.3, 2.7, 3.2, 2.9, 3.35])
    choice = cal.choose([_point(None, [3.5] * 6), noisy, trained], 500.0)
    assert choice["point"] is trained and "within the noise" in choice["why"]
    # lower on every row by 0.05 +- 0.01: a real gain
    clear = _point(200.0, [x - 0.05 + 0.01 * (i % 2) for i, x in enumerate(trained["row_losses"])])
    choice = cal.choose([clear, trained], 500.0)
    assert choice["point"] is clear and choice["gain"]["nats"] > 0
    # a trained value missing from the grid: no scaling is what the others must beat
    none = _point(None, [3.0, 3.2, 2.9, 3.1, 3.0, 3.3])
    assert cal.choose([none, noisy], 500.0)["point"] is none
