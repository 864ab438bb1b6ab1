"""Runs side by side: the HyPE ablation (teacher, HyPE student and ablation student by NIAH length,
with CSR, perplexity and held-out KL) and one change against its baseline (paired differences)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import environment
from bench.real.pictures import figure
from bench.real.run_folder import read_json
from bench.real.summary import result_stem

NIAH_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3")


def cmd_compare(a) -> int:
    """The HyPE ablation: NIAH by length of the teacher, the HyPE student and the ablation student
    (the same corpus, budgets and attention layers), with CSR, perplexity and held-out KL beside it;
    writes ``real_ablation_<pe>.json`` and ``real_ablation_<pe>_niah.png`` and prints the table."""
    hype_path, arm_path = (a.results / "real_conversion.json",
                           a.results / f"{result_stem(a.pe)}.json")
    missing = [str(p) for p in (hype_path, arm_path) if not p.exists()]
    if missing:
        raise SystemExit(f"error: compare needs both runs' results; missing: {', '.join(missing)}")
    hype, arm = read_json(hype_path), read_json(arm_path)
    # results from before the pe field: HyPE
    if arm.get("pe") != a.pe or hype.get("pe", "hype") != "hype":
        raise SystemExit(f"error: {arm_path} holds pe={arm.get('pe')!r} and {hype_path} "
                         f"pe={hype.get('pe')!r}; expected {a.pe!r} and 'hype'")
    models = {"teacher": hype["niah_summary"]["teacher"], "hype": hype["niah_summary"]["student"],
              a.pe: arm["niah_summary"]["student"]}
    lengths = sorted({int(L) for m in models.values() for t in NIAH_TASKS
                      for L in (m or {}).get(t, {}).get("by_length", {})})
    niah = {name: {t: {L: (m or {}).get(t, {}).get("by_length", {}).get(str(L)) for L in lengths}
                   for t in NIAH_TASKS} for name, m in models.items()}
    layers = (lambda r: (r.get("selection") or {}).get("attn_layers")  # noqa: E731
              or (r.get("settings") or {}).get("attn_layers"))
    out = {"pe": a.pe, "lengths": lengths, "niah": niah,
           "csr": {"teacher": hype.get("csr_teacher"), "hype": hype.get("csr_student"),
                   a.pe: arm.get("csr_student")},
           "ppl": {"teacher": (hype.get("ppl") or {}).get("teacher"),
                   "hype": (hype.get("ppl") or {}).get("student"),
                   a.pe: (arm.get("ppl") or {}).get("student")},
           "kl_heldout": {k: {"hype": hype.get(f"kl_heldout_{k}"), a.pe: arm.get(f"kl_heldout_{k}")}
                          for k in ("stage1", "stage2", "stage3")},
           "attn_layers": {"hype": layers(hype), a.pe: layers(arm)},
           "tokens": {k: {"hype": hype.get(f"tokens_{k}"), a.pe: arm.get(f"tokens_{k}")}
                      for k in ("stage1", "stage2", "stage3")},
           "calibrated_a": {"hype": (hype.get("calibration") or {}).get("chosen_a"),
                            a.pe: (arm.get("calibration") or {}).get("chosen_a")},
           "sources": {"hype": str(hype_path.name), a.pe: str(arm_path.name)},
           "environment": environment()}
    path = a.results / f"real_ablation_{a.pe}.json"
    path.write_text(json.dumps(out, indent=2, default=str))
    print(ablation_table(out))
    _ablation_png(out, a.results / f"real_ablation_{a.pe}_niah.png")
    print(f"[real] wrote {path}")
    return 0


def cmd_compare_runs(a) -> int:
    """One change against its baseline: the students' paired differences per NIAH cell, CSR task
    and held-out CE (same prompts, items and rows), printed and written to
    ``compare_<arm stem>.json``."""
    from halo_dist.eval.scorecard import compare, compare_markdown

    runs = {}
    for name, path in (("base", a.base), ("arm", a.arm)):
        if not path.exists():
            raise SystemExit(f"error: --{name} {path}: no such results file")
        r = read_json(path)
        runs[name] = {"niah": {"records": (r.get("niah_records") or {}).get("student") or []},
                      "csr": (r.get("csr") or {}).get("student"),
                      "ppl": (r.get("ppl") or {}).get("student")}
    diff = compare(runs["base"], runs["arm"])
    table = compare_markdown(diff, a.base.stem, a.arm.stem)
    print(table)
    out = a.results / f"compare_{a.arm.stem}.json"
    out.write_text(json.dumps({"base": str(a.base), "arm": str(a.arm), "diff": diff,
                               "table": table}, indent=2, default=str))
    print(f"[real] wrote {out}")
    return 0


def ablation_table(out: dict) -> str:
    from halo_dist.eval.niah_report import format_length

    lengths, names = out["lengths"], list(out["niah"])
    head = "| model | " + " | ".join(f"S{t[-1]} {format_length(L)}" for t in NIAH_TASKS
                                     for L in lengths)
    rows = [head + " |", "|---|" + "---|" * (len(NIAH_TASKS) * len(lengths))]
    for name in names:
        cells = [out["niah"][name][t][L] for t in NIAH_TASKS for L in lengths]
        rows.append(f"| {name} | " + " | ".join("–" if v is None else f"{v:.0%}" for v in cells)
                    + " |")
    return "\n".join(rows)


def _ablation_png(out: dict, path: Path) -> Path:
    """NIAH accuracy by context length, one panel per task: teacher, HyPE student, ablation
    student."""
    from halo_dist.eval.niah_report import format_length

    lengths = out["lengths"]
    fig = figure(4.2 * len(NIAH_TASKS), 3.4)
    for i, task in enumerate(NIAH_TASKS):
        ax = fig.add_subplot(1, len(NIAH_TASKS), i + 1)
        for name, style in zip(out["niah"], ("k--", "o-", "s-")):
            vals = [out["niah"][name][task][L] for L in lengths]
            ax.plot(range(len(lengths)), [float("nan") if v is None else v for v in vals], style,
                    label=name)
        ax.axvline(lengths.index(8192) + 0.5 if 8192 in lengths else -1, color="grey", lw=0.8,
                   ls=":")
        ax.set_xticks(range(len(lengths)), [format_length(L) for L in lengths])
        ax.set(title=task, xlabel="context (tokens)", ylabel="accuracy", ylim=(-0.03, 1.03))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"HyPE vs {out['pe']} (same data, budgets, layers); dotted: the teacher's 8K "
                 "trained positions")
    fig.savefig(path, dpi=100)
    return path

