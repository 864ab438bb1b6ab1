"""Attention-layer selection: score formula, ranking, --from-results, M(i) evaluation with
reuse."""

import json

import pytest
import torch
from conftest import tiny_qwen3

from halo_dist import cli
from halo_dist.eval import selection as sel
from halo_dist.eval.errors import EvalError
from halo_dist.eval.layerwise import (LayerwiseRunner, Stage1Weights, evaluate_layers,
                                      teacher_as_hypenet)
from halo_dist.eval.proxies import (KLProbe, ProbeEvaluator, RetrievalProbe,
                                    associative_recall_rows, random_token_batches)
from halo_dist.models.convert import convert_model

# hand-computed: max R = 0.9, max C = 0.6
TABLE = {0: (0.9, 0.60), 1: (0.5, 0.50), 2: (0.8, 0.55), 3: (0.2, 0.58)}
EXPECTED = {0: 0.0, 1: 0.4 / 0.100001, 2: 0.1 / 0.050001, 3: 0.7 / 0.020001}


def table_results():
    return {i: {"recall": r, "csr": c} for i, (r, c) in TABLE.items()}


def test_score_formula_and_ranking_match_hand_computed_table():
    scores = sel.halo_scores(table_results())
    assert scores == pytest.approx(EXPECTED, rel=1e-9)
    assert sel.top_k(scores, 2) == [1, 3]
    assert sel.top_k(scores, 1) == [3]
    assert sel.top_k({0: 1.0, 1: 1.0, 2: 0.5}, 1) == [0]  # ties: lower index first
    payload = sel.select_layers("halo", 4, 2, table_results())
    assert payload["attn_layers"] == [1, 3] and payload["ranking"] == [3, 1, 2, 0]


def test_baseline_methods():
    assert sel.select_layers("even", 28, 7)["attn_layers"] == [0, 4, 8, 12, 16, 20, 24]
    assert sel.select_layers("latter-half", 28, 7)["attn_layers"] == [14, 16, 18, 20, 22, 24, 26]
    assert sel.select_layers("given", 28, given=[25, 2, 3])["attn_layers"] == [2, 3, 25]
    assert sel.select_layers("even", 28)["num_attn"] == 7  # default floor(L/4)
    with pytest.raises(EvalError, match="out of range"):
        sel.select_layers("given", 28, given=[30])


def test_a_csr_offset_keeps_the_same_layers_on_two_stage1_runs(tmp_path, capsys):
    """The real SmolLM2 conversion's per-layer results of two stage-1 runs of one recipe (an H200's
    and an H100's): the paper's 1e-6 keeps layers 27 and 29, whose replacement costs no recall,
    and trades the recall-critical layer 23 for 25 on one of them; an offset of 0.01 keeps the
    same set on both, layer 23 included."""
    from pathlib import Path

    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    runs = [json.loads((results / "real_selection_v2_h200_second.json").read_text())["results"],
            json.loads((results / "real_conversion.json").read_text())["selection"]["results"]]
    kept = {}
    for n, raw in enumerate(runs):
        src = tmp_path / f"run{n}.json"
        src.write_text(json.dumps(raw))
        for offset in ("1e-6", "0.01"):
            out = tmp_path / f"sel{n}_{offset}.json"
            assert cli.main(["select-layers", "--from-results", str(src), "--num-attn", "7",
                             "--csr-offset", offset, "--output", str(out)]) == 0
            kept[n, offset] = json.loads(out.read_text())["attn_layers"]
    assert kept[0, "1e-6"] == [7, 18, 19, 21, 23, 27, 29]
    assert kept[1, "1e-6"] == [7, 18, 19, 21, 25, 27, 29]
    assert kept[0, "0.01"] == kept[1, "0.01"] == [3, 7, 16, 18, 19, 21, 23]
    capsys.readouterr()
    assert cli.main(["select-layers", "--from-results", str(src), "--csr-offset", "0",
                     "--output", str(tmp_path / "x.json")]) == 2
    assert "--csr-offset" in capsys.readouterr().err


def test_from_results_round_trip(tmp_path):
    src, out = tmp_path / "results.json", tmp_path / "sel.json"
    raw = {str(i): {"recall": r, "csr": c, "squad": r / 2} for i, (r, c) in TABLE.items()}
    src.write_text(json.dumps(raw))
    assert cli.main(["select-layers", "--from-results", str(src), "--num-attn", "2", "--output",
                     str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["attn_layers"] == [1, 3]
    assert {int(k): v for k, v in got["scores"].items()} == pytest.approx(EXPECTED, rel=1e-9)
    assert got["results"] == raw  # extra keys survive
    # the written results file reloads identically
    sel.save_results(tmp_path / "again.json", sel.load_results(src))
    assert json.loads((tmp_path / "again.json").read_text()) == raw


@pytest.mark.parametrize(
    "raw, extra_args, message",
    [
        ({"0": {"recall": 0.5, "csr": 0.5}, "2": {"recall": 0.5, "csr": 0.5}}, [],
         r"missing layers \[1\]"),
        ({"0": {"recall": 1.5, "csr": 0.5}}, [], "outside"),
        ({"0": {"recall": 0.5}}, [], "'csr' is missing"),
        ({"0": {"recall": "high", "csr": 0.5}}, [], "must be a number"),
        ({"x": {"recall": 0.5, "csr": 0.5}}, [], "not a layer index"),
        ({"0": {"recall": 0.5, "csr": 0.5}, "1": {"recall": 0.4, "csr": 0.5}}, ["--num-attn", "3"],
         "larger than the layer count 2"),
        ({"0": {"recall": 0.5, "csr": 0.5}}, ["--num-layers", "3"], r"missing layers \[1, 2\]"),
    ],
)
def test_bad_results_files_are_one_line_errors(tmp_path, capsys, raw, extra_args, message):
    src = tmp_path / "results.json"
    src.write_text(json.dumps(raw))
    code = cli.main(["select-layers", "--from-results", str(src), "--output",
                     str(tmp_path / "o.json"), *extra_args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error:") and len(err.strip().splitlines()) == 2, err
    assert __import__("re").search(message, err.splitlines()[0]), err
    assert not (tmp_path / "o.json").exists()


def test_missing_or_invalid_results_file(tmp_path, capsys):
    assert cli.main(["select-layers", "--from-results", str(tmp_path / "nope.json"), "--output",
                     str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    assert cli.main(["select-layers", "--from-results", str(tmp_path / "bad.json"), "--output",
                     str(tmp_path / "o")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert cli.main(["select-layers", "--method", "even", "--output", str(tmp_path / "o")]) == 2
    assert "needs the layer count" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# Evaluating M(i) on a tiny model
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """A saved tiny Qwen3 teacher (no tokenizer) and a stage-1 file with perturbed RNN weights for
    every layer."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("sel")
    teacher = tiny_qwen3(vocab=300)
    teacher.save_pretrained(root / "teacher")
    all_rnn = convert_model(teacher, [])
    g = torch.Generator().manual_seed(0)
    weights = {k: v + 0.05 * torch.randn(v.shape, generator=g)
               for k, v in all_rnn.state_dict().items() if ".mixer." in k}
    save_file(weights, str(root / "s1.safetensors"), metadata={"num_hidden_layers": "4"})
    return root, teacher


def probe_evaluator():
    recall = RetrievalProbe(associative_recall_rows(300, n_rows=4, n_pairs=16), batch_size=2)
    return ProbeEvaluator(recall, KLProbe(random_token_batches(300, 48, 4, 2)))


def test_cached_evaluation_equals_naive_m_i(tiny_setup):
    """Prefix reuse + in-place swap give exactly the metrics of a freshly converted M(i)."""
    root, teacher = tiny_setup
    base = teacher_as_hypenet(teacher)
    results = evaluate_layers(base, Stage1Weights(root / "s1.safetensors", base), probe_evaluator(),
                              log=lambda m: None)
    assert sorted(results) == [0, 1, 2, 3]
    for i in range(4):
        m_i = convert_model(teacher, [j for j in range(4) if j != i],
                            stage1_weights=root / "s1.safetensors", stage1_layers=[i],
                            attn_rope=True, attn_logits_scale_base=None, attn_output_gate=False)
        ref = probe_evaluator()
        ref.start(teacher_as_hypenet(teacher))  # teacher outputs for the KL reference
        naive = ref._score(LayerwiseRunner(m_i, ref.runner.batches).outputs(0), m_i.lm_head)
        for key in ("recall", "csr", "kl", "top1_agreement"):
            assert results[i][key] == pytest.approx(naive[key], rel=1e-5, abs=1e-6), (i, key)
    assert all(r["csr"] < 1.0 for r in results.values())  # a replaced layer changes the function


def test_select_layers_end_to_end_and_resume(tiny_setup, tmp_path, monkeypatch):
    root, _ = tiny_setup
    out, res = tmp_path / "sel.json", tmp_path / "res.json"
    args = ["select-layers", "--teacher", str(root / "teacher"), "--stage1-weights",
            str(root / "s1.safetensors"), "--evaluator", "proxy", "--output", str(out),
            "--results-out", str(res), "--recall-items", "4", "--kl-rows", "4", "--kl-seq-len",
            "32", "--batch-size", "2"]
    assert cli.main(args) == 0
    got, results = json.loads(out.read_text()), json.loads(res.read_text())
    assert (sorted(results) == ["0", "1", "2", "3"] and got["num_attn"] == 1
            and len(got["attn_layers"]) == 1)
    # ranking from the saved file agrees with the evaluating run
    ranked = sel.select_from_results_file(res)
    assert (ranked["attn_layers"] == got["attn_layers"]
            and ranked["scores"] == pytest.approx(got["scores"]))
    assert got["teacher_metrics"]["csr"] == pytest.approx(1.0)
    # resume: drop two layers from the file; only those are evaluated again
    res.write_text(json.dumps({k: v for k, v in results.items() if k in ("0", "1")}))
    seen = []
    original = ProbeEvaluator.evaluate
    monkeypatch.setattr(ProbeEvaluator, "evaluate",
                        lambda self, base, i: seen.append(i) or original(self, base, i))
    assert cli.main(args + ["--resume"]) == 0
    assert seen == [2, 3]
    final = json.loads(res.read_text())
    assert sorted(final) == ["0", "1", "2", "3"]
    # deterministic: the re-run reproduces the first
    assert final["3"] == pytest.approx(results["3"])


def test_stage1_file_that_does_not_match_the_teacher(tiny_setup, tmp_path):
    from safetensors.torch import save_file

    _, teacher = tiny_setup
    base = teacher_as_hypenet(teacher)
    cases = {
        "trained for 28 layers": ({}, {"num_hidden_layers": "28"}),
        "has shape": ({"model.layers.1.mixer.q_proj.weight": torch.zeros(3, 3)}, None),
        "not an RNN-mixer parameter": ({"model.layers.9.mixer.q_proj.weight": torch.zeros(64, 64)},
                                       None),
    }
    for message, (tensors, meta) in cases.items():
        path = tmp_path / "bad.safetensors"
        save_file(tensors, str(path), metadata=meta)
        with pytest.raises(EvalError, match=message):
            Stage1Weights(path, base)
    save_file({"model.layers.1.mixer.o_norm.weight": torch.ones(64)}, str(path))
    with pytest.raises(EvalError, match=r"no RNN weights for layers \[0, 2, 3\]"):
        evaluate_layers(base, Stage1Weights(path, base), probe_evaluator(), log=lambda m: None)


def test_evaluator_without_data_is_refused(tiny_setup, tmp_path, capsys):
    root, _ = tiny_setup
    base = ["select-layers", "--teacher", str(root / "teacher"), "--stage1-weights",
            str(root / "s1.safetensors"), "--output", str(tmp_path / "o.json")]
    assert cli.main(base + ["--evaluator", "olmo-eval"]) == 2
    assert "needs a tokenizer" in capsys.readouterr().err
    assert cli.main(base + ["--heldout", str(tmp_path / "missing.json")]) == 2
    assert "--heldout" in capsys.readouterr().err
    with pytest.raises(EvalError, match="no items"):
        RetrievalProbe([])
    with pytest.raises(EvalError, match="no held-out batches"):
        KLProbe([])


def test_m_i_runs_the_rnn_layer_with_the_rope_stage1_aligned_it_with(tiny_setup, tmp_path):
    """A stage-1 file of a model.pe without RNN RoPE (all_nope, attn_rope_rnn_nope) is scored
    without it; files from before the key keep RoPE."""
    from safetensors.torch import load_file

    from halo_dist.stages.stage1 import save_stage1_weights

    root, teacher = tiny_setup
    base = teacher_as_hypenet(teacher)
    path = save_stage1_weights(load_file(str(root / "s1.safetensors")), tmp_path / "s1", 4, "tiny",
                               rnn_rope=False)
    assert Stage1Weights(path, base).mixer(1).config.rnn_rope is False
    assert Stage1Weights(root / "s1.safetensors", base).mixer(1).config.rnn_rope is True
    assert base.config.rnn_rope is True  # the teacher base itself is untouched


def test_the_kl_proxy_reads_as_many_held_out_rows_as_asked(shards, capsys):
    """``--kl-rows`` rows of held-out shards, in batches of at most ``--batch-size``: one row is one
    row (not a whole batch of them), and more rows than a batch fill whole batches."""
    from types import SimpleNamespace

    from halo_dist.eval.commands import _kl_batches

    def rows(kl_rows, batch_size):
        args = SimpleNamespace(heldout=str(shards), kl_seq_len=32, kl_rows=kl_rows,
                               batch_size=batch_size)
        return [tuple(b["input_ids"].shape) for b in _kl_batches(args, None, 4096)]

    assert rows(1, 8) == [(1, 32)]
    assert rows(4, 8) == [(4, 32)]
    assert rows(16, 8) == [(8, 32), (8, 32)]
    assert rows(12, 8) == [(6, 32), (6, 32)]
    capsys.readouterr()
    assert cli.main(["select-layers", "--teacher", "unused", "--stage1-weights", "unused",
                     "--output", str(shards.parent / "sel.json"), "--kl-rows", "0"]) == 2
    assert "--kl-rows must be >= 1, got 0" in capsys.readouterr().err
