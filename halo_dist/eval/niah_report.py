"""NIAH summaries and reports: the JSON, a task x length Markdown table and depth x length
heatmaps of a ``niah.run_niah`` report.

A cell is one (task, length). Its figure is the rate over the needles placed inside the haystack
(depths below 1.0), with its Wilson interval and n. Needles at depth 1.0 sit right before the
question, where a model that only remembers the last few hundred tokens (an RNN layer's recency)
finds them without retrieving anything: they are reported apart (``end``), never mixed into the
cell.
"""

from __future__ import annotations

from pathlib import Path

from .stats import format_rate, rate

END_DEPTH = 1.0


def summarize(records: list[dict]) -> dict:
    """Per task: ``cells`` {length: rate dict over depths < 1}, ``end`` {length: rate dict at depth
    1.0}, ``by_length`` {length: the cell's rate} (the end rate where a length has only end
    needles), ``by_cell`` {length: {depth: rate}} for the heatmap, and ``mean`` over the cells'
    prompts."""
    grouped: dict = {}
    for r in records:
        grouped.setdefault(r["task"], {}).setdefault(r["length"], {}).setdefault(
            r["depth"], []).append(bool(r["correct"]))
    summary = {}
    for task, lengths in grouped.items():
        entry: dict = {"cells": {}, "end": {}, "by_cell": {}, "by_length": {}}
        inside_all = []
        for L, depths in lengths.items():
            inside = [x for d, v in depths.items() if d < END_DEPTH for x in v]
            end = [x for d, v in depths.items() if d >= END_DEPTH for x in v]
            entry["by_cell"][L] = {d: sum(v) / len(v) for d, v in depths.items()}
            if inside:
                entry["cells"][L] = rate(sum(inside), len(inside))
            if end:
                entry["end"][L] = rate(sum(end), len(end))
            entry["by_length"][L] = (entry["cells"].get(L) or entry["end"][L])["rate"]
            inside_all += inside or end
        entry["mean"] = sum(inside_all) / len(inside_all) if inside_all else 0.0
        summary[task] = entry
    return summary


def cell_line(records: list[dict]) -> str:
    """One cell's figures for a log line: ``inside 85% [73-92] n=50; at the end 5/5``."""
    inside = [r["correct"] for r in records if r["depth"] < END_DEPTH]
    end = [r["correct"] for r in records if r["depth"] >= END_DEPTH]
    parts = [f"inside {format_rate(rate(sum(inside), len(inside)))}"] if inside else []
    if end:
        parts.append(f"at the end {sum(end)}/{len(end)}")
    return "; ".join(parts)


def format_length(n: int) -> str:
    if n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}M"
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def markdown_table(summary: dict, title: str = "") -> str:
    """Task x length table: each cell's rate with its 95% Wilson interval and n (needles inside the
    haystack), then one row per task of the needles at depth 1.0."""
    lengths = sorted({int(L) for e in summary.values() for L in e["by_length"]})
    lines = [f"### {title}"] if title else []
    lines.append("| task | " + " | ".join(format_length(L) for L in lengths) + " |")
    lines.append("|---|" + "---|" * len(lengths))
    for part, label in (("cells", ""), ("end", " (needle at depth 1.0)")):
        for task, e in summary.items():
            row = _by_int_length(e.get(part, {}))
            if row:
                lines.append(f"| {task}{label} | "
                             + " | ".join(format_rate(row.get(L)) for L in lengths) + " |")
    lines.append("\n95% Wilson intervals; n = prompts. A cell counts needles inside the haystack "
                 "(depths below 1.0); needles at depth 1.0, right before the question, are listed "
                 "apart.")
    return "\n".join(lines) + "\n"


def _by_int_length(cells: dict) -> dict:
    """Length keys as ints (a summary read back from JSON has them as strings)."""
    return {int(L): v for L, v in cells.items()}


def heatmap(summary: dict, path: str | Path, title: str = "NIAH") -> Path:
    """Depth x length accuracy heatmap, one panel per task (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(summary)
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        cells = summary[task]["by_cell"]
        lengths = sorted(cells)
        depths = sorted({d for ds in cells.values() for d in ds})
        grid = [[cells[L].get(d, float("nan")) for L in lengths] for d in depths]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        ax.set_xticks(range(len(lengths)), [format_length(L) for L in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth")
        ax.set_title(task)
    fig.colorbar(im, ax=axes[0].tolist(), label="accuracy")
    fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def write_reports(report: dict, out_dir: str | Path, name: str = "niah") -> dict[str, Path]:
    """``<name>.json``, ``<name>.md`` and ``<name>_heatmap.png`` in ``out_dir``."""
    from .selection import write_json_atomic

    out_dir = Path(out_dir)
    paths = {"json": write_json_atomic(out_dir / f"{name}.json", report)}
    md = markdown_table(report["summary"], title=f"{name}: NIAH")
    (out_dir / f"{name}.md").write_text(md)
    paths["markdown"] = out_dir / f"{name}.md"
    paths["heatmap"] = heatmap(report["summary"], out_dir / f"{name}_heatmap.png",
                               title=str(report.get("model", name)))
    return paths
