"""Every figure of a real conversion's run folder: the scorecard and its headline keys, the goals,
the stages' throughput and curves, selection, calibration, speed and timings; and the name of the
results file."""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import environment
from bench.real.opd_arm import opd_summary
from bench.real.run_folder import read_json
from halo_dist.pipeline.demo import DemoSettings
from halo_dist.eval.scorecard import read_eval, scorecard


def result_stem(pe: str, seed: int | None = None, tag: str = "") -> str:
    """``real_conversion`` for the HyPE recipe at the preset's seed, ``real_conversion_<pe>`` for
    an ablation, ``..._<tag>`` for a named experiment and ``..._seed<N>`` for another seed (kept
    side by side)."""
    stem = "real_conversion" if pe in ("", "hype") else f"real_conversion_{pe}"
    stem += f"_{tag}" if tag else ""
    return stem if seed in (None, DemoSettings.seed) else f"{stem}_seed{seed}"



def stage_summary(run_dir: Path, windows: list[dict] | None = None) -> dict:
    """Tokens, throughput and MFU (bench_stages' medians of the logged intervals after the first),
    memory, and the held-out curves; with the background steps' ``windows`` (the demo's
    background.json) also the rates of the intervals that shared the GPU with them and of those that
    had it alone."""
    from bench.bench_stages import summarize_metrics
    from halo_dist.train.metrics import read_metrics

    if not (run_dir / "metrics.jsonl").exists():
        return {}
    rates = summarize_metrics(run_dir / "metrics.jsonl")
    series = read_metrics(run_dir)
    tokens = series.get("progress/tokens", [])
    return {"tokens": int(tokens[-1][1]) if tokens else None,
            "steps": int(tokens[-1][0]) if tokens else None,
            **{k: rates[k] for k in ("tokens_per_s", "mfu", "peak_mem_gib")},
            "sharing": sharing_rates(run_dir / "metrics.jsonl", windows or []),
            "loss_first_last": [series["train/loss"][0][1],
                                series["train/loss"][-1][1]] if "train/loss" in series else None,
            "eval": {t: series[t] for t in series if t.startswith("eval/")}}


def sharing_rates(path: Path, windows: list[dict]) -> dict:
    """Median tokens/s and MFU of the logged intervals that overlapped a background window and of
    the rest.

    An interval runs from the previous logged row's time to its own (rows of one resumed piece only:
    the first interval of each piece, compile and autotuning, is left out as in
    summarize_metrics)."""
    import statistics

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    groups: dict[str, list[dict]] = {"alone": [], "shared": []}
    prev = None
    for r in rows:
        if "perf/tokens_per_s" not in r:
            continue
        first_of_piece = prev is None or r["step"] <= prev["step"] or r["time"] - prev["time"] > 600
        if not first_of_piece:
            lo, hi = prev["time"], r["time"]
            shared = any(w["start"] < hi and w["end"] > lo for w in windows)
            groups["shared" if shared else "alone"].append(r)
        prev = r

    def med(rs, key):
        vals = [x[key] for x in rs if x.get(key) is not None]
        return statistics.median(vals) if vals else None

    return {name: {"intervals": len(rs), "tokens_per_s": med(rs, "perf/tokens_per_s"),
                   "mfu": med(rs, "perf/mfu")} for name, rs in groups.items()}


NIAH_LENGTHS = ("2K", "4K", "8K", "16K", "32K", "64K")


def summarize(work: Path, run: Path | None = None) -> dict:
    """Every figure of the run: the scorecard (teacher vs student with intervals), its headline
    keys, the goals, the stages' throughput and curves, selection, calibration, speed, timings."""
    run = run or work / "run"
    windows = read_json(run / "background.json") or []
    stages = {s: stage_summary(run / s, windows) for s in ("stage1", "stage2", "stage3")}
    kl = lambda s, i: (stages[s].get("eval", {}).get("eval/kl")  # noqa: E731
                       or [[None, None]])[i][1]
    evals = {w: read_eval(run / "eval" / w, w) for w in ("teacher", "student")}
    card = scorecard(evals["teacher"], evals["student"])
    settings = read_json(run / "settings.json")
    tokens = {k: stages[k].get("tokens") for k in stages}
    out = {
        # model.pe of stages 1-2: hype, or an ablation (all_rope, ...)
        "pe": (settings or {}).get("pe") or "hype", "seed": (settings or {}).get("seed"),
        **headline(card),
        # "after stage 1" = the hybrid that stage 2 starts from: stage-1 RNN layers + the selected
        # attention
        "kl_heldout_stage1": kl("stage2", 0), "kl_heldout_stage2": kl("stage2", -1),
        "kl_heldout_stage3": kl("stage3", -1),
        **{f"tokens_{k}": v for k, v in tokens.items()}, "gpu_minutes": gpu_minutes(run),
        "scorecard": card, "stages": stages, "ppl": {w: e["ppl"] for w, e in evals.items()},
        "csr": {w: e["csr"] for w, e in evals.items()},
        "niah_summary": {w: (e["niah"] or {}).get("summary") for w, e in evals.items()},
        # every prompt's outcome: another run's student is compared with this one prompt by
        # prompt (compare-runs)
        "niah_records": {w: [{k: r[k] for k in ("task", "length", "depth", "key", "correct")}
                             for r in (e["niah"] or {}).get("records", [])]
                         for w, e in evals.items()},
        "selection": read_json(run / "select" / "selection.json"),
        # experiment d: the OPD step after stage 3 (its arm, tokens, divergences), or None
        "opd": opd_summary(run),
        "calibration": read_json(run / "calibrate.json"), "speed": read_json(run / "speed.json"),
        "timings_s": read_json(run / "timings.json"), "background": windows,
        "corpus": read_json(work / "corpus" / "corpus_report.json"),
        "warmup": read_json(work / "warmup.json"), "settings": settings,
        "pieces": read_json(run / "pieces.json"),
        "environment": environment(),
    }
    trained = sum(v for v in tokens.values() if v)
    out["tokens_per_gpu_minute"] = (trained / out["gpu_minutes"]
                                    if trained and out["gpu_minutes"] else None)
    out["goals"] = goals(out)
    return out


def headline(card: dict) -> dict:
    """The figures the goals and README's table quote: NIAH-S1 cells of both models (rate, n and
    Wilson interval), the CSR ratio and margin ratio, the perplexity ratio."""
    from halo_dist.eval.niah import parse_length

    cells = card["niah"].get("niah_single_1", {}).get("cells", {})
    out = {f"niah_s1_{who}_{L.lower()}": cells.get(parse_length(L), {}).get(who)
           for L in NIAH_LENGTHS for who in ("student", "teacher")}
    mean = card["csr"].get("mean", {})
    out.update(csr_teacher=mean.get("teacher"), csr_student=mean.get("student"),
               csr_ratio=mean.get("ratio"),
               csr_margin_ratio=(mean.get("margin") or {}).get("ratio"),
               ppl_ratio=card["ppl"].get("ratio"))
    return out


def goals(out: dict) -> dict:
    """The conversion's goals, each True / False, or None where its figure was not measured."""
    def at_least(key, bound):
        v = out.get(key)
        v = v.get("rate") if isinstance(v, dict) else v
        return None if v is None else v >= bound

    g = {f"niah_s1_student_{L} >= 0.9": at_least(f"niah_s1_student_{L}", 0.9)
         for L in ("2k", "4k", "8k")}
    g.update({f"niah_s1_student_{L} >= 0.8": at_least(f"niah_s1_student_{L}", 0.8)
              for L in ("16k", "32k")})
    g["csr_ratio >= 0.95"] = at_least("csr_ratio", 0.95)
    g["csr_margin_ratio >= 0.8"] = at_least("csr_margin_ratio", 0.8)
    g["ppl_ratio <= 1.15"] = None if out.get("ppl_ratio") is None else out["ppl_ratio"] <= 1.15
    if out["kl_heldout_stage1"] is not None and out["kl_heldout_stage2"] is not None:
        g["kl_heldout_stage2 < kl_heldout_stage1 / 2"] = (
            out["kl_heldout_stage2"] < out["kl_heldout_stage1"] / 2)
    return g


def gpu_minutes(run: Path) -> float | None:
    """Wall minutes of the run's pieces on the GPU machine (``pieces.json``, written around each
    ``run`` invocation), else the sum of the demo's step timings."""
    pieces = read_json(run / "pieces.json")
    if pieces:
        return sum(p["seconds"] for p in pieces) / 60
    timings = read_json(run / "timings.json")
    return sum(timings.values()) / 60 if timings else None

