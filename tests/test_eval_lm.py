"""eval-lm through lm-evaluation-harness on offline local tasks, and the olmo-eval CSR
probe."""

import json
from pathlib import Path

import pytest
from conftest import tiny_qwen3

from halo_dist import cli
from halo_dist.eval.errors import EvalError
from halo_dist.eval.layerwise import LayerwiseRunner
from halo_dist.eval.lm_eval_bridge import markdown, resolve_tasks, run_lm_eval, summarize
from halo_dist.eval.olmo_sets import CSR_TASKS, SETS, load_task_docs, olmo_datasets_root
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


@pytest.mark.slow
def test_lm_eval_on_local_tasks_matches_our_choice_probe(tiny_hypenet):
    """lm-eval (HFLM around our HypeNet) and the prefix-cached probe agree on acc and acc_norm."""
    tok = byte_tokenizer()
    tasks = ["arc_easy", "arc_challenge"]
    summary = run_lm_eval(tiny_hypenet, tok, tasks, limit=4, batch_size=4)
    assert set(summary["tasks"]) == set(tasks) and all(m["n"] == 4
                                                       for m in summary["tasks"].values())
    probe = ChoiceProbe(tok, {t: load_task_docs(t, 4) for t in tasks}, batch_size=4)
    ours = probe.score(LayerwiseRunner(tiny_hypenet, probe.batches).outputs(0),
                       tiny_hypenet.lm_head)
    for t in tasks:
        assert ours[f"{t}/acc"] == pytest.approx(summary["tasks"][t]["acc"])
        assert ours[f"{t}/acc_norm"] == pytest.approx(summary["tasks"][t]["acc_norm"])
    assert summary["csr"] == pytest.approx(ours["csr"])


@pytest.mark.slow
def test_eval_lm_cli_on_an_exported_hypenet(tiny_hypenet, tmp_path, capsys):
    folder = tmp_path / "model"
    export_hypenet(tiny_hypenet, folder, tokenizer=byte_tokenizer())
    out = tmp_path / "csr.json"
    assert cli.main(["eval-lm", "--model", str(folder), "--tasks", "hellaswag", "--limit", "3",
                     "--output", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["tasks"]["hellaswag"]["n"] == 3 and 0 <= saved["csr"] <= 1
    assert "| hellaswag |" in capsys.readouterr().out
    assert cli.main(["eval-lm", "--model", str(folder), "--tasks", "no_such_task_xyz", "--limit",
                     "2"]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.fixture(scope="module")
def exported(tiny_hypenet, tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    export_hypenet(tiny_hypenet, folder, tokenizer=byte_tokenizer())
    return folder


@pytest.mark.slow
def test_csr_mean_names_the_tasks_it_covers(exported, capsys):
    """Two CSR tasks give a mean labelled with those two (not the five-task CSR); no CSR task: no
    CSR line."""
    assert cli.main(["eval-lm", "--model", str(exported), "--tasks", "arc_easy,piqa", "--limit",
                     "2"]) == 0
    out = capsys.readouterr().out
    assert "| **CSR mean (arc_easy, piqa)** |" in out and out.count("CSR") == 1
    assert (summarize({"x": {"acc,none": 0.5}}, ["custom"], ["x"])
            == {"tasks": {"custom": {"acc": 0.5, "stderr": None}}, "csr": None, "csr_tasks": [],
                "csr_se": None, "csr_chance": None})
    assert "CSR" not in markdown({"tasks": {"custom": {"acc": 0.5}}, "csr": None, "csr_tasks": []})


# A task lm-eval knows whose dataset lives only on the hub (never saved, never cached: always
# unreachable here).
HUB_ONLY_TASK = """task: hub_only_task
dataset_path: halo-dist-tests/no-such-dataset
test_split: test
output_type: multiple_choice
doc_to_text: q
doc_to_choice: c
doc_to_target: 0
metric_list:
  - metric: acc
"""


@pytest.mark.slow
def test_task_without_offline_data_is_one_error_line(exported, tmp_path, capsys):
    (tmp_path / "hub_only_task.yaml").write_text(HUB_ONLY_TASK)
    args = ["eval-lm", "--model", str(exported), "--tasks", "arc_easy,hub_only_task", "--limit",
            "2", "--include-path", str(tmp_path)]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err
    assert errors[0].startswith("error: lm-eval task 'hub_only_task': its dataset is not saved "
                                "offline")
    assert "--include-path" in errors[0]


def test_local_task_files_are_written_once(tmp_path):
    names, folder = resolve_tasks(["arc_challenge", "custom_task"], tmp_path)
    assert names == ["halo_arc_challenge", "custom_task"]
    yaml = (folder / "halo_arc_challenge.yaml").read_text()
    assert "dataset_path: json" in yaml and "acc_norm" in yaml
    assert sum(1 for _ in open(folder / "halo_arc_challenge.jsonl")) == 299
    with pytest.raises(EvalError, match="no tasks"):
        resolve_tasks([], tmp_path)


# Every item of each validation set: what run_lm_eval(..., limit=None) evaluates.
FULL_SIZES = {"hellaswag": 10042, "arc_easy": 570, "arc_challenge": 299, "piqa": 1838,
              "winogrande": 1267}
# lm-eval's own task configs of the same sets (their prompts and, for winogrande, partial
# evaluation).
BUILTIN_YAML = {"hellaswag": "hellaswag/hellaswag.yaml", "arc_easy": "arc/arc_easy.yaml",
                "arc_challenge": "arc/arc_challenge.yaml", "piqa": "piqa/piqa.yaml",
                "winogrande": "winogrande/default.yaml"}


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    resolve_tasks(list(CSR_TASKS), folder)
    return folder


@pytest.fixture(scope="module")
def task_manager(task_folder):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(task_folder)])


def builtin_task(task: str):
    """lm-eval's registered task for ``task``, fed the saved raw documents instead of the hub
    dataset."""
    import datasets
    import lm_eval
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml

    cfg = load_yaml(Path(lm_eval.__file__).parent / "tasks" / BUILTIN_YAML[task])
    folder, split = SETS[task]
    raw = datasets.load_from_disk(str(olmo_datasets_root() / folder / split))
    # every split the config names reads the saved validation set, which our local task holds too
    cfg["custom_dataset"] = lambda **_: datasets.DatasetDict(
        {s: raw for s in ("train", "validation", "test")})
    cfg.pop("dataset_kwargs", None)
    return ConfigurableTask(config=cfg)


@pytest.mark.slow
@pytest.mark.parametrize("task", CSR_TASKS)
def test_local_tasks_make_lm_eval_builtin_requests(task, task_manager):
    """Our JSONL + YAML task asks the model exactly what lm-eval's own task asks, and scores it the
    same."""
    ours = task_manager.load("halo_" + task)["tasks"]["halo_" + task]
    theirs = builtin_task(task)
    for t in (ours, theirs):
        t.build_all_requests(limit=4)
    assert [i.arguments for i in ours.instances] == [i.arguments for i in theirs.instances]
    assert len(ours.instances) >= 8
    if task == "winogrande":  # two contexts, one shared continuation
        assert (ours.multiple_input == 2
                and ours.instances[0].arguments[1] == ours.instances[1].arguments[1])
        assert ours.instances[0].arguments[0] != ours.instances[1].arguments[0]
    ours_docs, their_docs = list(ours.eval_docs)[:4], list(theirs.eval_docs)[:4]
    for k, (a, b) in enumerate(zip(ours_docs, their_docs)):
        n = len(ours.doc_to_choice(a))
        # the pick that wins decides acc: both tasks must agree on the gold index
        for best in range(n):
            lls = [(0.0 if c == best else -5.0 - c, False) for c in range(n)]
            assert (ours.process_results(a, lls)["acc"]
                    == theirs.process_results(b, lls)["acc"]), (k, best)


@pytest.mark.slow
def test_all_five_tasks_run_and_summarize(tiny_hypenet, task_folder):
    """Full local sets are written; lm-eval runs all five at an explicit batch size; csr mixes
    acc_norm/acc."""
    for task, n in FULL_SIZES.items():
        assert sum(1 for _ in open(task_folder / f"halo_{task}.jsonl")) == n
    summary = run_lm_eval(tiny_hypenet, byte_tokenizer(), list(CSR_TASKS), limit=2, batch_size=64,
                          task_dir=task_folder)
    table = summary["tasks"]
    assert list(table) == list(CSR_TASKS) and all(m["n"] == 2 for m in table.values())
    assert "acc_norm" not in table["winogrande"] and all("acc_norm" in table[t]
                                                         for t in CSR_TASKS[:4])
    expected = [table[t]["acc_norm"] for t in CSR_TASKS[:4]] + [table["winogrande"]["acc"]]
    assert summary["csr"] == pytest.approx(sum(expected) / 5)
    docs = load_task_docs("winogrande", 1)[0]
    assert set(docs) == {"contexts", "continuation", "gold"} and len(docs["contexts"]) == 2
