"""NIAH reports: the JSON, a task x length Markdown table and depth x length heatmaps of a
``niah.run_niah`` report (``summary`` as ``niah.summarize`` makes it)."""

from __future__ import annotations

from pathlib import Path


def format_length(n: int) -> str:
    if n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}M"
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def markdown_table(summary: dict, title: str = "") -> str:
    """Task x length accuracy table (percent), one row per task plus their mean."""
    lengths = sorted({L for e in summary.values() for L in e["by_length"]})
    lines = [f"### {title}"] if title else []
    lines.append("| task | " + " | ".join(format_length(L) for L in lengths) + " | mean |")
    lines.append("|---|" + "---|" * (len(lengths) + 1))
    for task, e in summary.items():
        cells = [f"{100 * e['by_length'][L]:.1f}" if L in e["by_length"] else "–" for L in lengths]
        lines.append(f"| {task} | " + " | ".join(cells) + f" | {100 * e['mean']:.1f} |")
    return "\n".join(lines) + "\n"


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
    md = markdown_table(report["summary"], title=report.get("model", name))
    (out_dir / f"{name}.md").write_text(md)
    paths["markdown"] = out_dir / f"{name}.md"
    paths["heatmap"] = heatmap(report["summary"], out_dir / f"{name}_heatmap.png",
                               title=str(report.get("model", name)))
    return paths
