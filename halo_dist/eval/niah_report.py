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
# where in the context a needle sits (depth x length, tokens): a model may find far needles and miss
# the ones near the start, which a per-length cell mixes together
OFFSET_EDGES = (1024, 2048, 4096)


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


def offset_buckets() -> list[str]:
    """The buckets of ``OFFSET_EDGES`` in order: ``0-1K``, ``1K-2K``, ``2K-4K``, ``4K+``."""
    lows = (0,) + OFFSET_EDGES
    return [f"{format_length(lo) if lo else 0}-{format_length(hi)}"
            for lo, hi in zip(lows, OFFSET_EDGES)] + [f"{format_length(OFFSET_EDGES[-1])}+"]


def offset_bucket(depth: float, length: int) -> str:
    """The bucket of the needle's offset from the context's start (depth x length tokens)."""
    return _OFFSET_LABELS[sum(depth * length >= edge for edge in OFFSET_EDGES)]


def format_length(n: int) -> str:
    if n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}M"
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


_OFFSET_LABELS = offset_buckets()


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
    """Depth x length accuracy heatmap of one model, one panel per task, as a PNG."""
    from ..figures import save

    return save(heatmap_figure({"": summary}, title), path)


def heatmap_figure(summaries: dict[str, dict], title: str = "NIAH"):
    """Depth x length heatmaps: one row per model (``{name: summary}``; an empty name for one
    model), one panel per task, each cell's rate written in it and the prompts per cell in the
    panel's title."""
    from ..figures import new_figure

    tasks = list(dict.fromkeys(t for summary in summaries.values() for t in summary))
    cols = max(len(_grid(s[t])[0]) for s in summaries.values() for t in s)
    rows = max(len(_grid(s[t])[1]) for s in summaries.values() for t in s)
    fig = new_figure(len(tasks) * max(3.0, 1.2 + 0.55 * cols) + 1.2,
                     len(summaries) * (1.5 + 0.24 * rows) + 0.5)
    image = None
    for r, (who, summary) in enumerate(summaries.items()):
        for c, task in enumerate(tasks):
            ax = fig.add_subplot(len(summaries), len(tasks), r * len(tasks) + c + 1)
            if task in summary:
                image = _heatmap_panel(ax, summary[task], f"{who}: {task}" if who else task)
            else:
                ax.set_visible(False)
    fig.colorbar(image, ax=fig.axes, label="needles found (share)", shrink=0.8)
    fig.suptitle(title)
    return fig


def _grid(entry: dict) -> tuple[list[int], list[float], dict]:
    """``(lengths, depths, {length: {depth: rate}})`` of a task's summary entry (its keys may be
    strings: a summary read back from JSON)."""
    cells = {int(L): {float(d): v for d, v in ds.items()} for L, ds in entry["by_cell"].items()}
    return sorted(cells), sorted({d for ds in cells.values() for d in ds}), cells


def _per_cell(entry: dict) -> str:
    """``n = 5 per cell`` when every cell inside the haystack holds the same number of prompts
    (else ``n varies by cell``)."""
    lengths, _, cells = _grid(entry)
    counts = set()
    for L in lengths:
        inside = [d for d in cells[L] if d < END_DEPTH]
        n = (_by_int_length(entry.get("cells", {})).get(L) or {}).get("n")
        if inside and n:
            counts.add(n / len(inside))
    return f"n = {int(counts.pop())} per cell" if len(counts) == 1 else "n varies by cell"


def _heatmap_panel(ax, entry: dict, title: str):
    lengths, depths, cells = _grid(entry)
    grid = [[cells[L].get(d, float("nan")) for L in lengths] for d in depths]
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
    ax.set_xticks(range(len(lengths)), [format_length(L) for L in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    for y, row in enumerate(grid):
        for x, v in enumerate(row):
            if v == v:  # not NaN; white on the dark ends of the colour map
                ax.text(x, y, f"{v:.0%}", ha="center", va="center", fontsize=7,
                        color="white" if v < 0.25 or v > 0.85 else "black")
    ax.set(title=f"{title}\n{_per_cell(entry)}", xlabel="context length (tokens)",
           ylabel="needle depth")
    return image


def write_reports(report: dict, out_dir: str | Path, name: str = "niah") -> dict[str, Path]:
    """``<name>.json``, ``<name>.md`` and ``<name>_heatmap.png`` in ``out_dir``."""
    from .selection import write_json_atomic

    out_dir = Path(out_dir)
    paths = {"json": write_json_atomic(out_dir / f"{name}.json", report)}
    md = markdown_table(report["summary"], title=f"{name}: NIAH")
    (out_dir / f"{name}.md").write_text(md)
    paths["markdown"] = out_dir / f"{name}.md"
    paths["heatmap"] = heatmap(report["summary"], out_dir / f"{name}_heatmap.png",
                               title=f"NIAH: {name}")  # the model's path would be its title
    return paths
