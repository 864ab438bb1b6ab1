"""Uncertainty of evaluation figures: Wilson intervals for rates, standard errors for means, and
the above-chance margin of a multiple-choice score.

A NIAH cell or a CSR task is a count of correct answers over n prompts, so every figure here comes
with the n it was measured on. Two models scored on the same prompts are compared item by item
(``paired_difference``): the variance of a difference of two correlated rates is far smaller than
the sum of their variances, which is what makes a one-change experiment readable at n in the
hundreds.
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a rate ``correct / n``. Unlike the normal approximation it stays
    inside [0, 1] and is not zero-width at 0% or 100% (20 of 20 correct: [0.84, 1.0])."""
    if n <= 0:
        return (0.0, 1.0)
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def rate(correct: int, n: int) -> dict:
    """``{"correct", "n", "rate", "ci95"}`` of a count of correct answers (rate None when n is
    0)."""
    return {"correct": int(correct), "n": int(n), "rate": correct / n if n else None,
            "ci95": list(wilson(correct, n))}


def mean_se(p: float, n: int) -> float:
    """Standard error of a mean of ``n`` 0/1 outcomes with mean ``p`` (the sample standard deviation
    over sqrt(n), as lm-eval reports it)."""
    if n <= 1:
        return float("nan")
    return math.sqrt(p * (1 - p) / (n - 1))


def paired_difference(a: list[float], b: list[float]) -> dict:
    """Mean of ``a - b`` over the same items (0/1 outcomes or per-row losses), with its standard
    error and normal 95% interval."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired outcomes need the same non-zero length, got {len(a)} and "
                         f"{len(b)}")
    d = [float(x) - float(y) for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1) if n > 1 else float("nan")
    se = math.sqrt(var / n) if n > 1 else float("nan")
    return {"diff": mean, "se": se, "ci95": [mean - Z95 * se, mean + Z95 * se], "n": n}


def margin_ratio(student: float, teacher: float, chance: float,
                 se_student: float = 0.0, se_teacher: float = 0.0) -> dict:
    """How much of the teacher's margin above chance the student keeps: (s - c) / (t - c), with a
    first-order (delta-method) standard error from the two scores' errors. A teacher within two
    standard errors of chance has no margin to keep: the ratio is then reported but flagged."""
    margin = teacher - chance
    if margin <= 0:
        return {"ratio": None, "se": None, "teacher_margin": margin, "resolved": False}
    ratio = (student - chance) / margin
    se = math.sqrt(se_student ** 2 + (ratio * se_teacher) ** 2) / margin
    return {"ratio": ratio, "se": se, "teacher_margin": margin,
            "resolved": margin > 2 * math.hypot(se_student, se_teacher)}


def format_rate(entry: dict | None) -> str:
    """``85% [73-92] n=50`` (or ``–`` for a missing cell)."""
    if not entry or entry.get("rate") is None:
        return "–"
    lo, hi = entry["ci95"]
    return f"{100 * entry['rate']:.0f}% [{100 * lo:.0f}-{100 * hi:.0f}] n={entry['n']}"
