"""Pictures a reader can trust: every picture the demo's report, the evaluation
suite and the real conversion draw has both axes labelled, no absolute path in any text, no text
drawn over another panel's, integer optimizer steps, teacher and student on one axis where they are
compared, and CSR as bars with 95% intervals and the chance level.

The figures are caught as they are saved (``Figure.savefig``), so each picture is checked as the
product builds it, from a run folder laid out as the demo writes one.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import yaml
from matplotlib.container import ErrorbarContainer
from matplotlib.figure import Figure
from matplotlib.text import Text

# a path from the root (/tmp/x, /home/u/...), not a unit such as nats/token
ABS_PATH = re.compile(r"(?<![\w.)\]])/[\w.~-]")
STUDENT_PATH = "/tmp/halo/run/hypenet"
TASKS = ("hellaswag", "arc_easy", "arc_challenge")


@pytest.fixture
def saved(monkeypatch) -> list[Figure]:
    """The figures the code under test saves (nothing is written)."""
    figures: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self))
    return figures


def _ticks(axis) -> list[Text]:
    """The tick labels an axis draws: those of ticks inside its view (the locator may place more,
    which are not drawn)."""
    lo, hi = sorted(axis.get_view_interval())
    eps = 1e-9 * max(1.0, abs(hi - lo))
    return [tick.label1 for tick in axis.get_major_ticks()
            if tick.label1.get_visible() and lo - eps <= tick.get_loc() <= hi + eps]


def _texts(ax) -> list[Text]:
    """An axes' title, axis labels and drawn tick labels (what may collide with a neighbour)."""
    texts = [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label,
             *_ticks(ax.xaxis), *_ticks(ax.yaxis)]
    return [t for t in texts if t.get_visible() and t.get_text().strip()]


def problems(fig: Figure) -> list[str]:
    """What makes a picture untrustworthy (empty: none)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    found = [f"absolute path in {t.get_text()!r}" for t in fig.findobj(Text)
             if ABS_PATH.search(t.get_text())]
    axes = [ax for ax in fig.axes if ax.get_visible() and ax.axison]
    for ax in axes:
        colorbar = ax.get_label() == "<colorbar>"
        if not (ax.get_ylabel().strip() and (colorbar or ax.get_xlabel().strip())):
            found.append(f"unlabelled axis in {ax.get_title()!r}")
        ticks = [t.get_window_extent(renderer) for t in _ticks(ax.xaxis) if t.get_text().strip()]
        if any(a.overlaps(b) for i, a in enumerate(ticks) for b in ticks[i + 1:]):
            found.append(f"x tick labels overlap in {ax.get_title()!r}")
        if "step" in ax.get_xlabel():
            lo, hi = ax.get_xlim()
            if any(lo <= x <= hi and not float(x).is_integer() for x in ax.get_xticks()):
                found.append(f"fractional steps in {ax.get_title()!r}")
    boxes = {id(ax): [t.get_window_extent(renderer) for t in _texts(ax)] for ax in axes}
    if fig._suptitle is not None:
        boxes["suptitle"] = [fig._suptitle.get_window_extent(renderer)]
    for ax in axes:
        others = [b for key, bs in boxes.items() if key != id(ax) for b in bs]
        area = ax.get_window_extent(renderer)
        if any(box.overlaps(area) for box in boxes.get("suptitle", [])):
            found.append(f"the suptitle covers {ax.get_title()!r}")
        for box in boxes[id(ax)]:
            if any(box.overlaps(other) for other in others):
                found.append(f"text of {ax.get_title()!r} overlaps another panel's text")
                break
            if any(box.overlaps(o.get_window_extent(renderer)) for o in axes if o is not ax):
                found.append(f"text of {ax.get_title()!r} is drawn over another panel")
                break
    return found


def _stage(root: Path, stage: str, objective: str, steps: int, evals: dict[str, float]) -> None:
    folder = root / stage
    folder.mkdir(parents=True)
    config = {"stage": {"name": stage}, "loss": {"objective": objective, "ce_weight": 0.0,
                                                 "kl_max_position": None}}
    (folder / "config.yaml").write_text(yaml.safe_dump({"config": config}))
    records = [{"step": s, "time": float(s), "train/loss": 10.0 / s, "progress/tokens": 512.0 * s,
                "perf/tokens_per_s": 100.0} for s in range(1, steps + 1)]
    records += [{"step": s, "time": float(s), **{t: v * (1 if "teacher" in t else 1 + 1 / (s + 1))
                                                 for t, v in evals.items()}} for s in (0, steps)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


# the sizes of the tiny preset (one length, two depths, one prompt each, 4 CSR items) and of the
# real conversion
SHAPES = {"tiny": {"lengths": {t: (160,) for t in ("niah_single_1", "niah_single_2",
                                                   "niah_single_3")},
                   "depths": (0.0, 1.0), "samples": 1, "items": 4},
          "real": {"lengths": {"niah_single_1": (2048, 4096, 8192, 16384, 32768, 65536),
                               "niah_single_2": (2048, 4096, 8192),
                               "niah_single_3": (2048, 4096, 8192)},
                   "depths": tuple(d / 10 for d in range(11)), "samples": 5, "items": 500}}


def _model_eval(folder: Path, who: str, model: str, rng: random.Random, shape: dict) -> None:
    from halo_dist.eval.niah_report import summarize

    records = [{"task": t, "length": n, "depth": d, "key": f"k{i}", "correct": rng.random() < 0.5}
               for t, ls in shape["lengths"].items() for n in ls for d in shape["depths"]
               for i in range(shape["samples"])]
    (folder / "niah").mkdir(parents=True)
    (folder / "niah" / f"{who}.json").write_text(json.dumps(
        {"model": model, "records": records, "summary": summarize(records)}))
    tasks = {}
    n = shape["items"]
    for task in TASKS:
        items = "".join(rng.choice("01") for _ in range(n))
        p = items.count("1") / n
        tasks[task] = {"n": n, "acc": p, "acc_norm": p, "stderr": (p * (1 - p) / (n - 1)) ** 0.5,
                       "chance": 0.25, "items": items}
    (folder / "csr.json").write_text(json.dumps(
        {"tasks": tasks, "csr": 0.45, "csr_tasks": list(TASKS), "csr_se": 0.05,
         "csr_chance": 0.25, "model": model}))
    ppl = 20.0 if who == "teacher" else 2300.0
    (folder / "ppl.json").write_text(json.dumps(
        {"model": model, "ppl": ppl, "ppl_ci95": [ppl * 0.9, ppl * 1.1], "ce": 3.0, "ce_se": 0.05,
         "rows": 8, "seq_len": 256, "row_ce": [3.0] * 8}))


def fake_run(root: Path, shape: str = "real") -> Path:
    """A demo output folder: three stages' metrics, both models' evaluations at the sizes of
    ``shape`` (:data:`SHAPES`), a calibration."""
    rng = random.Random(0)
    _stage(root, "stage1", "mse", 12, {"eval/mse": 600.0})
    _stage(root, "stage2", "kl", 14, {"eval/kl": 2.0, "eval/ce": 7.0, "eval/teacher_ce": 3.0})
    _stage(root, "stage3", "kl", 3, {"eval/kl": 2.5, "eval/ce": 7.5, "eval/teacher_ce": 3.1})
    for who, model in (("teacher", "/root/.cache/halo_dist/smollm2"), ("student", STUDENT_PATH)):
        _model_eval(root / "eval" / who, who, model, rng, SHAPES[shape])
    (root / "calibrate.json").write_text(json.dumps(
        {"seq_len": 1024, "chosen_a": 500.0, "why": "the trained value", "curve": [
            {"a": None, "loss": 7.61, "row_losses": [7.6, 7.62]},
            {"a": 500.0, "loss": 7.6, "row_losses": [7.6, 7.6]}]}))
    return root


def test_the_check_is_not_vacuous():
    """A picture with the issue's defects fails the check."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = Figure(figsize=(6, 3))
    FigureCanvasAgg(fig)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    left.plot([0, 1, 2], [3, 2, 1])
    left.set(title=STUDENT_PATH, xlabel="step")
    right.set(ylabel="a label long enough to run over the left panel " * 2)
    found = " | ".join(problems(fig))
    for defect in ("absolute path", "unlabelled axis", "fractional steps", "over"):
        assert defect in found, (defect, found)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_demo_reports_pictures_are_labelled_pathless_and_apart(tmp_path, saved, shape):
    from halo_dist.pipeline.report import write_report

    out = fake_run(tmp_path / "demo", shape)
    report = write_report(out, [8, 12, 14, 15, 16, 17, 24], 60.0).read_text()
    assert len(saved) == 5, len(saved)  # three stages' curves, NIAH heatmaps, CSR bars
    for fig in saved:
        assert problems(fig) == [], problems(fig)
    headings = [line for line in report.splitlines() if line.startswith("#")]
    assert not [h for h in headings if ABS_PATH.search(h)], headings
    _check_curves(saved[:3])
    _check_csr(saved[-1], TASKS)


def _check_curves(figures: list[Figure]) -> None:
    """Loss axes say what they measure; the teacher's CE is a line beside the student's."""
    stage1, stage2 = figures[0].axes, figures[1].axes
    assert "MSE" in stage1[0].get_ylabel() and len(stage1) == 1  # no empty CE panel
    assert "KL" in stage2[0].get_ylabel() and "nats" in stage2[0].get_ylabel()
    ce = [ax for ax in stage2 if "CE" in ax.get_ylabel()]
    assert len(ce) == 1 and {line.get_label() for line in ce[0].get_lines()} >= {"student",
                                                                                   "teacher"}


def _check_csr(fig: Figure, tasks) -> None:
    """Bars with 95% error bars per model and the chance level of each task; only tasks that ran
    are named."""
    (ax,) = fig.axes
    assert sum(isinstance(c, ErrorbarContainer) for c in ax.containers) == 2
    chance = [line for line in ax.get_lines() if line.get_label() == "chance"]
    levels = [y for line in chance for y in line.get_ydata() if y == y]  # NaN: between tasks
    assert levels and all(abs(y - 25.0) < 1e-9 for y in levels)
    words = " ".join(t.get_text() for t in fig.findobj(Text)).lower()
    assert "winogrande" not in words and all(t in words for t in tasks)


def test_the_real_conversions_pictures_are_labelled_pathless_and_apart(tmp_path, saved):
    from bench.real_conversion import pictures

    run = fake_run(tmp_path / "run")
    assert len(pictures(run, tmp_path / "results")) == 3
    assert len(saved) == 3
    for fig in saved:
        assert problems(fig) == [], problems(fig)
    _check_csr(saved[2], TASKS)


def test_the_niah_heatmap_of_the_evaluation_suite_is_titled_without_the_model_path(tmp_path,
                                                                                  saved):
    from halo_dist.eval.niah_report import write_reports

    run = fake_run(tmp_path / "run")
    report = json.loads((run / "eval" / "student" / "niah" / "student.json").read_text())
    write_reports(report, tmp_path / "niah", name="student")
    (fig,) = saved
    assert problems(fig) == [], problems(fig)
