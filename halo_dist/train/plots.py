"""Pictures of training runs: each stage's loss and held-out curves, labelled with what they
measure.

A run folder (``logging.run_dir``) holds ``metrics.jsonl`` and the resolved ``config.yaml``; the
config says which loss the stage trains (stage 1's MSE of layer outputs, a KL to the teacher, ...),
so the axis can name it with its unit. Per run, one column: the training loss with its held-out
value, and, where the run evaluates next-token cross-entropy, the student's held-out CE with the
teacher's on the same axis (the gap is the figure that matters).
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

import yaml

from ..figures import new_figure, save
from .metrics import read_metrics

PathLike = Union[str, Path]
LOSS_NAMES = {"mse": "MSE", "kl": "KL(teacher ‖ student)", "reverse_kl": "KL(student ‖ teacher)",
              "jsd": "Jensen-Shannon divergence", "ce": "next-token CE"}
UNITS = {"mse": "per token, summed over layers"}  # the others are nats per token
STAGE_TITLES = {"stage1": "stage 1: layer alignment", "stage2": "stage 2: distillation",
                "stage3": "stage 3: long context", "opd": "on-policy distillation",
                "pretrain": "pre-training"}
HELD_OUT = {"mse": "eval/mse", "kl": "eval/kl"}  # the held-out value of a training loss
CE_TAGS = (("eval/ce", "student"), ("eval/teacher_ce", "teacher"))


def loss_names(run_dir: PathLike) -> tuple[str, str, str]:
    """``(stage, training loss, unit)`` from the run's ``config.yaml`` (``("", "loss", "")``
    without one). The held-out value of the same objective is measured at every position and
    without the CE term, so it differs from the training loss where those are set."""
    try:
        cfg = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())["config"]
        stage, loss = cfg["stage"]["name"], cfg["loss"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return "", "loss", ""
    objective = loss.get("objective")
    name = LOSS_NAMES.get(objective, str(objective))
    if loss.get("kl_max_position") and objective == "kl":
        name = f"KL below position {loss['kl_max_position']}, CE beyond"
    if loss.get("ce_weight"):
        name = f"{name} + {loss['ce_weight']:g} × CE"
    return stage, name, UNITS.get(objective, "nats/token")


def curves_figure(runs: dict[str, PathLike]):
    """One column per run (``{name: run folder}``): the loss on top, the held-out CE of student and
    teacher below where the run measures it (a run without spans the column)."""
    from matplotlib.gridspec import GridSpec

    series = {name: read_metrics(folder) for name, folder in runs.items()}
    for name, s in series.items():
        if "train/loss" not in s:
            raise ValueError(f"no train/loss in {runs[name]}: nothing to plot")
    with_ce = {name: any(tag in s for tag, _ in CE_TAGS) for name, s in series.items()}
    rows = 2 if any(with_ce.values()) else 1
    fig = new_figure(4.8 * len(runs), 2.9 * rows + 0.4)
    grid = GridSpec(rows, len(runs), figure=fig)
    for col, (name, folder) in enumerate(runs.items()):
        stage, loss, unit = loss_names(folder)
        title = STAGE_TITLES.get(stage or name, name)
        top = fig.add_subplot(grid[0, col] if with_ce[name] else grid[:, col])
        _loss_panel(top, series[name], loss, unit, title)
        if with_ce[name]:
            _ce_panel(fig.add_subplot(grid[1, col], sharex=top), series[name], title)
    return fig


def _loss_panel(ax, series: dict, loss: str, unit: str, title: str) -> None:
    """The training loss and its held-out value; the axis names the loss when both measure the
    same, the legend names each when they do not."""
    held = next((tag for tag in HELD_OUT.values() if tag in series), None)
    held_name = next((LOSS_NAMES[o] for o, tag in HELD_OUT.items() if tag == held), "")
    same = held is None or held_name == loss
    train = series["train/loss"]
    ax.plot(*zip(*train), marker="." if len(train) < 50 else None,  # a few points: show each
            label="training batches" if same else f"training: {loss}")
    if held:
        ax.plot(*zip(*series[held]), "o-",
                label="held-out rows" if same else f"held-out: {held_name}")
    values = [v for tag in ("train/loss", held) if tag in series for _, v in series[tag]]
    if values and min(values) > 0 and max(values) / min(values) > 30:
        _log_scale(ax)
    ax.set(title=title, xlabel="optimizer step",
           ylabel=f"{loss}, {unit}" if same else f"loss, {unit}")
    _finish(ax)


def _ce_panel(ax, series: dict, title: str) -> None:
    for tag, who in CE_TAGS:
        if tag in series:
            ax.plot(*zip(*series[tag]), "o-" if who == "student" else "s--", label=who)
    ax.set(title=f"{title}: held-out next-token CE", xlabel="optimizer step",
           ylabel="CE, nats/token")
    _finish(ax)


def _log_scale(ax) -> None:
    """Log y with plain numbers at the decades (the default writes 10^2 and labels minor ticks)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _finish(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)


def plot_loss_curves(runs: dict[str, PathLike], out_png: PathLike) -> Path:
    """PNG of :func:`curves_figure` (``{name: run folder}``)."""
    return save(curves_figure(runs), out_png)
