#!/usr/bin/env python3
"""One NIAH comparison table (Markdown) and plot (PNG) over the variants of a from-scratch sweep.

    python slurm/compare_sweep.py --runs $HALO_RUNS --variants transformer,hypenet-lightning-hype \\
        --output $HALO_RUNS/sweep_niah          # -> sweep_niah.md, sweep_niah.png

Reads ``<runs>/<variant>/niah/niah.json`` (``--niah-file`` changes the relative path); without
``--variants`` every ``<runs>/*/niah/niah.json`` is used. The reader is tolerant: it accepts the
``halo-dist eval-niah`` report (``{"summary": {task: {"by_length": {L: acc}}}}``, averaged over
tasks), ``{"by_length": {...}}``, ``{"accuracy"|"results"|"niah": {...}}``, a flat ``{length: acc}``
dict (lengths as 4096 / "4096" / "4K" / "niah_4k"; accuracies in [0, 1] or percent; values may be
dicts with "acc"/"accuracy"/"mean"), or a list of records ``[{"length": L, "correct": bool}, ...]``.
A variant whose file is missing or unreadable gets a row saying so; the table is always written.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

# 4096, 4K, niah_4k
LENGTH_RE = re.compile(r"^(?:[A-Za-z][A-Za-z0-9]*[_-])?(\d+(?:\.\d+)?)\s*([kKmM]?)$")
MIN_LENGTH = 128  # smaller numbers are not NIAH context lengths (e.g. the "1" of niah_single_1)
NESTED_KEYS = ("summary", "by_length", "accuracy", "accuracies", "results", "niah", "per_length",
               "lengths")
VALUE_KEYS = ("mean", "accuracy", "acc", "score", "value")


def parse_length(key) -> int | None:
    """4096, "4096", "4K", "4k", "niah_4k", "1M" -> tokens; None if the key is not a length."""
    if isinstance(key, bool):
        return None
    if isinstance(key, (int, float)):
        return int(key) if key >= MIN_LENGTH else None
    m = LENGTH_RE.match(str(key).strip())
    if not m:
        return None
    scale = {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]
    n = int(float(m.group(1)) * scale)
    return n if n >= MIN_LENGTH else None


def as_accuracy(value) -> float | None:
    """A number, or a dict holding one under a usual key; None if neither."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, dict):
        for key in VALUE_KEYS:
            if key in value:
                return as_accuracy(value[key])
    return None


def _flat(mapping: dict) -> dict[int, float]:
    out = {}
    for key, value in mapping.items():
        length, acc = parse_length(key), as_accuracy(value)
        if length is not None and acc is not None:
            out[length] = acc
    return out


def _mean_by_length(per_task: list[dict[int, float]]) -> dict[int, float]:
    lengths = sorted({L for d in per_task for L in d})
    return {L: sum(d[L] for d in per_task if L in d) / sum(1 for d in per_task if L in d)
            for L in lengths}


def _from_records(records: list) -> dict[int, float]:
    cells: dict[int, list[float]] = {}
    for r in records:
        if not isinstance(r, dict):
            continue
        length = parse_length(r.get("length", r.get("context_length", r.get("seq_len"))))
        hit = r.get("correct", r.get("accuracy", r.get("score")))
        acc = as_accuracy(hit)
        if length is not None and acc is not None:
            cells.setdefault(length, []).append(acc)
    return {L: sum(v) / len(v) for L, v in cells.items()}


def accuracy_by_length(data, depth: int = 0) -> dict[int, float]:
    """{length: accuracy in [0, 1]} from any of the accepted layouts (empty if none matched)."""
    if depth > 4:
        return {}
    if isinstance(data, list):
        return _from_records(data)
    if not isinstance(data, dict):
        return {}
    for key in NESTED_KEYS:
        if key in data:
            found = accuracy_by_length(data[key], depth + 1)
            if found:
                return _normalise(found)
    flat = _flat(data)
    if flat:
        return _normalise(flat)
    # {task: {...}} : one per-length dict per task, averaged
    per_task = [accuracy_by_length(v, depth + 1)
                for v in data.values() if isinstance(v, (dict, list))]
    per_task = [d for d in per_task if d]
    if per_task:
        return _normalise(_mean_by_length(per_task))
    if "records" in data:
        return _normalise(_from_records(data["records"]))
    return {}


def _normalise(acc: dict[int, float]) -> dict[int, float]:
    """Percentages (any value > 1) become fractions."""
    if acc and max(acc.values()) > 1.0:
        return {L: v / 100.0 for L, v in acc.items()}
    return acc


def format_length(n: int) -> str:
    if n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}M"
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def load_variant(path: Path) -> tuple[dict[int, float], str]:
    """(accuracies, problem); problem is '' when the file was read."""
    if not path.is_file():
        return {}, f"missing ({path})"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return {}, f"unreadable ({path.name}: {err.__class__.__name__})"
    acc = accuracy_by_length(data)
    return (acc, "") if acc else ({}, f"no per-length accuracies in {path.name}")


def markdown(results: dict[str, tuple[dict[int, float], str]], title: str) -> str:
    lengths = sorted({L for acc, _ in results.values() for L in acc})
    lines = [f"## {title}", "",
             "NIAH accuracy (%) by context length; mean over the lengths evaluated.", ""]
    lines.append("| variant | " + " | ".join(format_length(L) for L in lengths) + " | mean |")
    lines.append("|---|" + "---:|" * (len(lengths) + 1))
    for name, (acc, problem) in results.items():
        if problem:
            lines.append(f"| {name} | " + " | ".join("–" for _ in lengths) + f" | {problem} |")
            continue
        cells = [f"{100 * acc[L]:.1f}" if L in acc else "–" for L in lengths]
        mean = 100 * sum(acc.values()) / len(acc)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {mean:.1f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, tuple[dict[int, float], str]], path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("warning: matplotlib is not installed: no plot written", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(9, 5.5))
    styles = ["-", "--", ":", "-."]
    for i, (name, (acc, problem)) in enumerate(results.items()):
        if problem or not acc:
            continue
        xs = sorted(acc)
        ax.plot(xs, [100 * acc[x] for x in xs], marker="o",
                linestyle=styles[(i // 10) % len(styles)], label=name)
    ax.set_xscale("log", base=2)
    ticks = sorted({L for acc, _ in results.values() for L in acc})
    if ticks:
        ax.set_xticks(ticks)
        ax.set_xticklabels([format_length(L) for L in ticks])
    ax.set_ylim(-2, 102)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("NIAH accuracy (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", required=True, help="sweep run folder (one sub-folder per variant)")
    p.add_argument("--variants", default="",
                   help="comma list, in table order (default: every folder with results)")
    p.add_argument("--niah-file", default="niah/niah.json",
                   help="results path inside a variant folder")
    p.add_argument("--output", required=True, help="output prefix: writes PREFIX.md and PREFIX.png")
    p.add_argument("--title", default="From-scratch sweep: NIAH")
    args = p.parse_args(argv)

    runs = Path(args.runs)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    if not names:
        names = sorted(f.parts[-1 - len(Path(args.niah_file).parts)]
                       for f in runs.glob(f"*/{args.niah_file}"))
    if not names:
        print(f"error: no variants given and no {runs}/*/{args.niah_file} found", file=sys.stderr)
        return 2
    results = {name: load_variant(runs / name / args.niah_file) for name in names}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = markdown(results, args.title)
    md_path = out.with_name(out.name + ".md")
    md_path.write_text(table)
    png = plot(results, out.with_name(out.name + ".png"), args.title)
    print(table)
    print(f"wrote {md_path}" + (f", {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
