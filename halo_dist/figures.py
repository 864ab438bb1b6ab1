"""How halo_dist draws its pictures: matplotlib Figures on the Agg canvas (no pyplot, so no global
state and no display needed), laid out by matplotlib's constrained layout so that no title, label or
tick label runs into a neighbouring panel."""

from __future__ import annotations

from pathlib import Path
from typing import Union


def new_figure(width: float, height: float):
    """An empty Figure of ``width`` x ``height`` inches."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig, path: Union[str, Path], dpi: int = 110) -> Path:
    """Write ``fig`` as a PNG at ``path`` (its folder made if needed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path
