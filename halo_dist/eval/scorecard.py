"""Teacher against student, every figure with its n and 95% interval: the scorecard of a
conversion.

Reads the files ``eval-suite`` writes for each model (``niah/<name>.json``, ``csr.json``,
``ppl.json``) and lines them up:

- NIAH: per task and length, each model's rate over the needles inside the haystack with its Wilson
  interval, and apart from it the needles at depth 1.0;
- CSR: per task, each model's score with its standard error, the task's chance level, the
  student-minus-teacher difference measured item by item (both models answer the same items), and
  the share of the teacher's margin above chance that the student keeps; the same for the mean;
- perplexity: each model's with the interval of its mean held-out CE, and their ratio.

A figure a part did not produce is None, never invented.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .stats import Z95, format_rate, margin_ratio, paired_difference


def read_eval(folder: str | Path, name: str) -> dict:
    """``{"niah", "csr", "ppl"}`` of one model's ``eval-suite`` folder (None where missing)."""
    folder = Path(folder)

    def load(path: Path):
        return json.loads(path.read_text()) if path.exists() else None

    return {"niah": load(folder / "niah" / f"{name}.json"), "csr": load(folder / "csr.json"),
            "ppl": load(folder / "ppl.json")}


def scorecard(teacher: dict, student: dict) -> dict:
    """Both models' figures side by side (see the module docstring)."""
    return {"niah": _niah(teacher.get("niah"), student.get("niah")),
            "csr": _csr(teacher.get("csr"), student.get("csr")),
            "ppl": _ppl(teacher.get("ppl"), student.get("ppl"))}


def _niah(teacher: dict | None, student: dict | None) -> dict:
    """From the reports' records (the source of truth: a report's stored summary may predate the
    current summary's fields)."""
    from .niah_report import summarize

    out: dict = {}
    for who, report in (("teacher", teacher), ("student", student)):
        for task, entry in summarize((report or {}).get("records") or []).items():
            for part in ("cells", "end"):
                for length, cell in entry.get(part, {}).items():
                    out.setdefault(task, {}).setdefault(part, {}).setdefault(
                        int(length), {})[who] = cell
    return out


def _csr(teacher: dict | None, student: dict | None) -> dict:
    if not teacher and not student:
        return {}
    tasks = list(((teacher or student) or {}).get("tasks", {}))
    per_task = {t: _csr_task((teacher or {}).get("tasks", {}).get(t),
                             (student or {}).get("tasks", {}).get(t)) for t in tasks}
    mean = {"teacher": (teacher or {}).get("csr"), "student": (student or {}).get("csr"),
            "teacher_se": (teacher or {}).get("csr_se"),
            "student_se": (student or {}).get("csr_se"),
            "chance": ((teacher or student) or {}).get("csr_chance")}
    if None not in (mean["teacher"], mean["student"]):
        mean["ratio"] = mean["student"] / mean["teacher"]
        if mean["chance"] is not None:
            mean["margin"] = margin_ratio(mean["student"], mean["teacher"], mean["chance"],
                                          mean["student_se"] or 0.0, mean["teacher_se"] or 0.0)
        diffs = [per_task[t].get("diff") for t in (student or {}).get("csr_tasks", [])]
        if diffs and None not in diffs:  # the mean's difference: the tasks' differences averaged
            se = math.sqrt(sum(d["se"] ** 2 for d in diffs)) / len(diffs)
            diff = sum(d["diff"] for d in diffs) / len(diffs)
            mean["diff"] = {"diff": diff, "se": se, "ci95": [diff - Z95 * se, diff + Z95 * se]}
    return {"tasks": per_task, "mean": mean}


def _csr_task(teacher: dict | None, student: dict | None) -> dict:
    from .lm_eval_bridge import csr_score

    t, s = (csr_score(m) if m else None for m in (teacher, student))
    row = {"teacher": t, "student": s, "n": (student or teacher or {}).get("n"),
           "teacher_se": (teacher or {}).get("stderr"), "student_se": (student or {}).get("stderr"),
           "chance": (teacher or student or {}).get("chance")}
    if t is not None and s is not None:
        if row["chance"] is not None:
            row["margin"] = margin_ratio(s, t, row["chance"], row["student_se"] or 0.0,
                                         row["teacher_se"] or 0.0)
        items = [(m or {}).get("items") for m in (student, teacher)]
        if all(items) and len(items[0]) == len(items[1]):
            row["diff"] = paired_difference([c == "1" for c in items[0]],
                                            [c == "1" for c in items[1]])
    return row


def _ppl(teacher: dict | None, student: dict | None) -> dict:
    out = {who: {k: r.get(k) for k in ("ppl", "ppl_ci95", "ce", "ce_se", "rows", "seq_len")}
           for who, r in (("teacher", teacher), ("student", student)) if r}
    if teacher and student:
        out["ratio"] = student["ppl"] / teacher["ppl"]
    return out


# ------------------------------------------------------------------------------------------------
# Markdown
# ------------------------------------------------------------------------------------------------


def markdown(card: dict) -> str:
    """The scorecard as three Markdown tables (NIAH, CSR, perplexity)."""
    return "\n".join(_niah_md(card["niah"]) + _csr_md(card["csr"]) + _ppl_md(card["ppl"]))


def _niah_md(niah: dict) -> list[str]:
    from .niah_report import format_length

    if not niah:
        return []
    lines = ["| NIAH | length | teacher | student |", "|---|---|---|---|"]
    for task, parts in niah.items():
        for part, label in (("cells", ""), ("end", " (depth 1.0)")):
            for length, cell in sorted(parts.get(part, {}).items()):
                lines.append(f"| {task}{label} | {format_length(length)} | "
                             f"{format_rate(cell.get('teacher'))} | "
                             f"{format_rate(cell.get('student'))} |")
    return lines + ["", "95% Wilson intervals; n = prompts; a cell counts needles inside the "
                    "haystack, depth 1.0 (right before the question) is listed apart.", ""]


def _csr_md(csr: dict) -> list[str]:
    if not csr:
        return []
    pct = lambda v: "–" if v is None else f"{100 * v:.1f}"  # noqa: E731
    lines = ["| CSR | n | chance | teacher | student | student - teacher | margin kept |",
             "|---|---|---|---|---|---|---|"]
    rows = list(csr["tasks"].items()) + [("mean", csr["mean"])]
    for task, r in rows:
        diff, margin = r.get("diff"), r.get("margin") or {}
        d = "–" if not diff else f"{100 * diff['diff']:+.1f} ± {100 * Z95 * diff['se']:.1f}"
        m = ("–" if margin.get("ratio") is None else
             f"{100 * margin['ratio']:.0f}% ± {100 * Z95 * margin['se']:.0f}"
             + ("" if margin.get("resolved") else " (teacher near chance)"))
        se = lambda who: ("" if r.get(f"{who}_se") is None  # noqa: E731
                          else f" ± {pct(r[f'{who}_se'])}")
        lines.append(f"| {task} | {r.get('n', '') or ''} | {pct(r.get('chance'))} | "
                     f"{pct(r.get('teacher'))}{se('teacher')} | {pct(r.get('student'))}"
                     f"{se('student')} | {d} | {m} |")
    return lines + ["", "Scores in percent ± one standard error; differences ± 95% (paired over "
                    "the same items); margin kept = (student - chance) / (teacher - chance).", ""]


def _ppl_md(ppl: dict) -> list[str]:
    if not ppl:
        return []
    lines = ["| perplexity | held-out rows x tokens | ppl | 95% interval |", "|---|---|---|---|"]
    for who in ("teacher", "student"):
        if who in ppl:
            r = ppl[who]
            lo, hi = r.get("ppl_ci95") or (None, None)
            ci = "–" if lo is None else f"{lo:.2f} - {hi:.2f}"
            lines.append(f"| {who} | {r.get('rows')} x {r.get('seq_len')} | {r['ppl']:.2f} | "
                         f"{ci} |")
    if "ratio" in ppl:
        lines.append(f"\nstudent / teacher perplexity: {ppl['ratio']:.3f}")
    return lines + [""]


# ------------------------------------------------------------------------------------------------
# Two models on the same prompts: the effect of one change
# ------------------------------------------------------------------------------------------------


def compare(base: dict, arm: dict) -> dict:
    """``arm - base`` for two models evaluated on the same prompts, items and rows (``read_eval``
    dicts): per NIAH cell (and per bucket of the needle's offset from the start, ``offsets``), CSR
    task and for the held-out CE, the paired difference with its standard error and 95% interval.
    An effect is one whose interval excludes 0."""
    from .niah_report import offset_bucket

    out: dict = {"niah": {}, "csr": {}, "ppl": None}
    keyed = [{(r["task"], r["length"], r["depth"], r["key"]): r["correct"]
              for r in ((m.get("niah") or {}).get("records") or [])} for m in (base, arm)]
    for (task, length, depth, key), b in sorted(keyed[0].items()):
        if (task, length, depth, key) in keyed[1]:
            a = keyed[1][(task, length, depth, key)]
            # a needle inside the haystack counts in its cell and, pooled over lengths, in the
            # bucket of its offset from the start; one at depth 1.0 only in its end cell
            places = ([("cells", length), ("offsets", offset_bucket(depth, length))]
                      if depth < 1.0 else [("end", length)])
            for part, where in places:
                cell = (out["niah"].setdefault(task, {}).setdefault(part, {})
                        .setdefault(where, [[], []]))
                cell[0].append(b)
                cell[1].append(a)
    for task, parts in out["niah"].items():
        for part, cells in parts.items():
            for length, (b, a) in cells.items():
                cells[length] = paired_difference(a, b)
    tasks = [((m.get("csr") or {}).get("tasks") or {}) for m in (base, arm)]
    for task in tasks[0]:
        items = [t.get(task, {}).get("items") for t in tasks]
        if all(items) and len(items[0]) == len(items[1]):
            out["csr"][task] = paired_difference([c == "1" for c in items[1]],
                                                 [c == "1" for c in items[0]])
    rows = [(m.get("ppl") or {}).get("row_ce") for m in (base, arm)]
    if all(rows) and len(rows[0]) == len(rows[1]):
        out["ppl"] = paired_difference(rows[1], rows[0])  # held-out CE, nats: negative is better
    return out


def compare_markdown(diff: dict, base: str = "base", arm: str = "arm") -> str:
    """The paired differences as one table; a * marks an interval that excludes 0."""
    from .niah_report import format_length, offset_buckets

    def fmt(d, scale=100.0, unit="pt", digits=1):
        if d["n"] < 2:  # no spread to measure: the difference alone
            return f"{scale * d['diff']:+.{digits}f} {unit} n={d['n']}"
        star = " *" if d["ci95"][0] > 0 or d["ci95"][1] < 0 else ""
        lo, mid, hi = (f"{scale * v:+.{digits}f}" for v in (d["ci95"][0], d["diff"], d["ci95"][1]))
        return f"{mid} {unit} [{lo}, {hi}] n={d['n']}{star}"

    lines = [f"| figure | {arm} - {base} (95% interval) |", "|---|---|"]
    for task, parts in diff["niah"].items():
        for part in ("cells", "end"):
            for length, d in sorted(parts.get(part, {}).items()):
                label = " (depth 1.0)" if part == "end" else ""
                lines.append(f"| {task}{label} {format_length(length)} | {fmt(d)} |")
        for where in offset_buckets():
            if where in parts.get("offsets", {}):
                lines.append(f"| {task}, needle at {where} (all lengths) | "
                             f"{fmt(parts['offsets'][where])} |")
    for task, d in diff["csr"].items():
        lines.append(f"| {task} | {fmt(d)} |")
    if diff["ppl"]:
        lines.append(f"| held-out CE | {fmt(diff['ppl'], 1.0, 'nats', 3)} |")
    return "\n".join(lines + ["", "Paired over the same prompts, items and rows; * = the interval "
                                  "excludes 0."]) + "\n"
