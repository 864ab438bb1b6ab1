"""The human progress line of a training run (``metrics.MetricsLogger`` prints one per logging
interval)::

    step 120/20000 (0.6%) | loss 2.3141 | lr 9.8e-05 | 16.2K tok/s | MFU 31.4% \\
        | mem 41.2/80.0 GiB | ETA 5h12m        (one line)
"""

from __future__ import annotations

import math
from typing import Optional


def format_si(value: float) -> str:
    """``16200 -> "16.2K"``, ``1.25e6 -> "1.25M"``, ``950 -> "950"``."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.0f}"


def format_duration(seconds: Optional[float]) -> str:
    """``18720 -> "5h12m"``, ``725 -> "12m05s"``, ``42 -> "42s"``, ``None -> "n/a"``."""
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    s = int(round(max(seconds, 0.0)))
    days, hours, minutes = s // 86400, s % 86400 // 3600, s % 3600 // 60
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{s % 60:02d}s"
    return f"{s}s"


def format_progress(step: int, total_steps: int, *, loss: Optional[float], lr: Optional[float],
                    tokens_per_s: Optional[float], mfu: Optional[float],
                    mem_gib: Optional[tuple[float, float]], eta_s: Optional[float]) -> str:
    """The one human progress line (units: lr absolute, mfu fraction, memory GiB used/total)."""
    parts = [
        f"step {step}/{total_steps} ({100.0 * step / max(total_steps, 1):.1f}%)",
        f"loss {loss:.4f}" if loss is not None else "loss n/a",
        f"lr {lr:.1e}" if lr is not None else "lr n/a",
        f"{format_si(tokens_per_s)} tok/s" if tokens_per_s is not None else "tok/s n/a",
        f"MFU {100.0 * mfu:.1f}%" if mfu is not None else "MFU n/a",
        f"mem {mem_gib[0]:.1f}/{mem_gib[1]:.1f} GiB" if mem_gib is not None else "mem n/a",
        f"ETA {format_duration(eta_s)}",
    ]
    return " | ".join(parts)
