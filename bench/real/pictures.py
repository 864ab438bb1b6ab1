"""The PNGs of a real conversion: training curves, the NIAH heatmaps of teacher and student side by
side, and the CSR bars."""

from __future__ import annotations

from pathlib import Path

from bench.real.run_folder import read_json


def pictures(run: Path, results: Path, stem: str = "real_conversion") -> list[Path]:
    made = []
    for fn in (_curves_png, _niah_png, _csr_png):
        try:
            path = fn(run, results / f"{stem}_{fn.__name__[1:-4]}.png")
        except (OSError, KeyError, ValueError) as e:  # a part not run yet
            print(f"[real] no {fn.__name__[1:-4]} picture yet ({e})")
            continue
        if path:
            made.append(path)
    return made


def figure(w, h):
    from halo_dist.figures import new_figure

    return new_figure(w, h)


def _curves_png(run: Path, path: Path) -> Path | None:
    """Per stage: the training loss with its held-out value, and the student's held-out CE beside
    the teacher's (``train.plots``: the demo report's curves, all stages in one picture)."""
    from halo_dist.train.plots import plot_loss_curves

    stages = {s: run / s for s in ("stage1", "stage2", "stage3")
              if (run / s / "metrics.jsonl").exists()}
    return plot_loss_curves(stages, path) if stages else None


def _niah_png(run: Path, path: Path) -> Path | None:
    """Teacher's and student's NIAH heatmaps (share found by depth x length), one row each."""
    from halo_dist.eval.niah_report import heatmap_figure, summarize
    from halo_dist.figures import save

    reports = {w: read_json(run / "eval" / w / "niah" / f"{w}.json")
               for w in ("teacher", "student")}
    if not all(reports.values()):
        return None
    summaries = {w: summarize(r["records"]) for w, r in reports.items()}
    return save(heatmap_figure(summaries, "NIAH: share of needles found by depth and length"),
                path, dpi=100)


def _csr_png(run: Path, path: Path) -> Path | None:
    """Bars per task, teacher vs student, with 95% intervals and the chance level (the demo
    report's picture)."""
    from halo_dist.pipeline.report import csr_figure, scorecard_of
    from halo_dist.figures import save

    csr = scorecard_of(run)["csr"]
    if not csr or not all(csr["mean"].get(w) is not None for w in ("teacher", "student")):
        return None
    return save(csr_figure(csr), path, dpi=100)

