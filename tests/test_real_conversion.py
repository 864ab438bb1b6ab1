"""bench/real_conversion.py's collection on the files a real conversion wrote (one H200 run of
2026-12-01, kept in tests/data/recorded_run: its metrics, evaluations and the summary collected
then)."""

import json
import shutil
from pathlib import Path

import pytest

import bench.real_conversion as rc

REPO = Path(__file__).resolve().parents[1]
RECORDED = REPO / "tests" / "data" / "recorded_run"


def test_summary_and_pictures_from_the_h200_run(tmp_path):
    run = tmp_path / "run"
    for stage in ("stage1", "stage2", "stage3"):
        (run / stage).mkdir(parents=True)
        shutil.copyfile(RECORDED / f"{stage}.metrics.jsonl",
                        run / stage / "metrics.jsonl")
    for who in ("teacher", "student"):
        (run / "eval" / who / "niah").mkdir(parents=True)
        shutil.copyfile(RECORDED / f"niah_{who}.json",
                        run / "eval" / who / "niah" / f"{who}.json")
    shutil.copyfile(RECORDED / "csr_teacher.json", run / "eval" / "teacher" / "csr.json")
    shutil.copyfile(RECORDED / "background.json", run / "background.json")
    out = rc.summarize(tmp_path)
    recorded = json.loads((RECORDED / "summary.json").read_text())
    for key in ("kl_heldout_stage1", "kl_heldout_stage2", "kl_heldout_stage3", "tokens_stage1",
                "tokens_stage2", "tokens_stage3", "csr_teacher"):
        assert out[key] == recorded[key], key
    # NIAH cells count the needles inside the haystack (depth < 1), with n and a Wilson interval
    records = json.loads((RECORDED / "niah_student.json").read_text())["records"]
    inside = [r["correct"] for r in records
              if r["task"] == "niah_single_1" and r["length"] == 16384 and r["depth"] < 1]
    cell = out["niah_s1_student_16k"]
    assert (cell["correct"], cell["n"]) == (sum(inside), len(inside)) and len(inside) > 0
    assert cell["ci95"][0] <= cell["rate"] <= cell["ci95"][1]
    assert out["scorecard"]["niah"]["niah_single_1"]["end"][16384]["student"]["n"] > 0
    for stage in ("stage1", "stage2", "stage3"):  # the throughput figures BENCHMARKS.md reports
        for key in ("tokens_per_s", "mfu", "peak_mem_gib", "sharing"):
            assert out["stages"][stage][key] == recorded["stages"][stage][key], (stage, key)
    assert (out["tokens_stage2"] == 916 * 128 * 512
            and out["goals"]["kl_heldout_stage2 < kl_heldout_stage1 / 2"])
    assert out["goals"]["niah_s1_student_16k >= 0.8"] is False
    assert out["csr_student"] is None and out["csr_ratio"] is None  # not run: null, never invented
    made = rc.pictures(run, tmp_path)
    # CSR needs both models
    assert [p.name for p in made] == ["real_conversion_curves.png", "real_conversion_niah.png"]


def test_stage_rates_split_by_the_background_steps_window():
    """Intervals that overlapped the teacher's background evaluation are counted apart from the
    rest; the first interval of each piece (compile, autotuning) belongs to neither."""
    path = RECORDED / "stage2.metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    timed = [r for r in rows if "perf/tokens_per_s" in r]
    pieces = 1 + sum(1 for a, b in zip(timed, timed[1:])
                     if b["step"] <= a["step"] or b["time"] - a["time"] > 600)
    alone = rc.sharing_rates(path, [])
    assert alone["shared"]["intervals"] == 0 and alone["alone"]["intervals"] == len(timed) - pieces
    middle = timed[len(timed) // 2]["time"]
    split = rc.sharing_rates(path,
                             [{"name": "eval-teacher", "start": timed[0]["time"], "end": middle}])
    assert split["shared"]["intervals"] + split["alone"]["intervals"] == len(timed) - pieces
    assert 0 < split["shared"]["intervals"] < len(timed) - pieces
    assert split["shared"]["tokens_per_s"] > 50_000 and split["alone"]["mfu"] > 0.1


def test_an_ablation_run_is_labelled_and_continued_only_with_its_pe(tmp_path):
    """run --pe all_rope reaches the demo settings; the results name the encoding; a continuation
    that changes it is refused (settings.json, which labels the results, would be rewritten)."""
    assert (rc.settings_for(rc.parse_args(["run", "--work", str(tmp_path), "--pe", "all_rope"])).pe
            == "all_rope")
    assert rc.settings_for(rc.parse_args(["run", "--work", str(tmp_path)])).pe == ""
    run = tmp_path / "run"
    run.mkdir()
    assert rc.summarize(tmp_path)["pe"] == "hype"  # no settings yet, or settings from before --pe
    rc.check_same_pe(run, "all_rope")  # a new run: any encoding
    (run / "settings.json").write_text(json.dumps({"pe": "all_rope"}))
    out = rc.summarize(tmp_path)
    assert out["pe"] == "all_rope" and out["settings"]["pe"] == "all_rope"
    rc.check_same_pe(run, "all_rope")
    with pytest.raises(SystemExit, match="started with --pe all_rope, not hype"):
        rc.check_same_pe(run, "")
    assert (rc.result_stem("hype") == "real_conversion"
            and rc.result_stem("all_rope") == "real_conversion_all_rope")


def test_ablation_compare_lines_up_both_runs_niah_and_refuses_a_mislabelled_file(tmp_path):
    by_len = lambda *v: {"by_length": {"2048": v[0], "16384": v[1]}}  # noqa: E731
    summary = lambda s1: {t: by_len(*s1) for t in rc.NIAH_TASKS}  # noqa: E731
    hype = {"pe": "hype",
            "niah_summary": {"teacher": summary((1.0, 0.0)), "student": summary((0.4, 0.05))},
            "csr_teacher": 0.46, "csr_student": 0.41, "selection": {"attn_layers": [7, 18]},
            "calibration": {"chosen_a": 200.0}}
    arm = {"pe": "all_rope", "niah_summary": {"teacher": None, "student": summary((0.9, 0.0))},
           "csr_student": 0.43, "settings": {"attn_layers": "7,18"}}
    (tmp_path / "real_conversion.json").write_text(json.dumps(hype))
    args = rc.parse_args(["compare", "--work", str(tmp_path), "--results", str(tmp_path)])
    with pytest.raises(SystemExit, match="missing: .*real_conversion_all_rope.json"):
        rc.cmd_compare(args)
    (tmp_path / "real_conversion_all_rope.json").write_text(json.dumps({**arm, "pe": "all_nope"}))
    with pytest.raises(SystemExit, match="pe='all_nope'"):
        rc.cmd_compare(args)
    (tmp_path / "real_conversion_all_rope.json").write_text(json.dumps(arm))
    assert rc.cmd_compare(args) == 0
    out = json.loads((tmp_path / "real_ablation_all_rope.json").read_text())
    assert out["lengths"] == [2048, 16384]
    assert out["niah"]["all_rope"]["niah_single_1"] == {"2048": 0.9, "16384": 0.0}
    assert out["niah"]["teacher"]["niah_single_2"]["2048"] == 1.0 and out["csr"]["hype"] == 0.41
    assert (out["attn_layers"] == {"hype": [7, 18], "all_rope": "7,18"}
            and out["calibrated_a"]["hype"] == 200.0)
    assert "| all_rope | 90% | 0% |" in rc.ablation_table(
        {**out, "niah": {k: {t: {int(L): v for L, v in c.items()}
                             for t, c in m.items()} for k, m in out["niah"].items()}})
    assert (tmp_path / "real_ablation_all_rope_niah.png").stat().st_size > 10_000


def test_hype_twin_switches_only_the_attention_encoding(tmp_path):
    """The speed of an ablation run is measured on its weights in the HyPE layout; the student is
    untouched."""
    student = tmp_path / "hypenet"
    student.mkdir()
    (student / "config.json").write_text(
        json.dumps({"attn_rope": True, "attn_logits_scale_base": None, "x": 1}))
    (student / "model.safetensors").write_bytes(b"w")
    twin = rc.hype_twin(student, tmp_path / "twin")
    assert (json.loads((twin / "config.json").read_text())
            == {"attn_rope": False, "attn_logits_scale_base": 500.0, "x": 1})
    assert json.loads((student / "config.json").read_text())["attn_rope"] is True
    assert (twin / "model.safetensors").read_bytes() == b"w" and rc.hype_twin(student, twin) == twin


def test_an_experiment_shares_the_baselines_stage1_only_when_its_settings_match(tmp_path):
    """--share-stage1-from: the arm's run folder gets the baseline's exported stage 1 and per-layer
    selection results as hard links; a setting stage 1 depends on that differs, a baseline without
    a finished stage 1, or an arm without a tag is refused."""
    from argparse import Namespace
    from dataclasses import asdict

    a = Namespace(work=tmp_path, tag="sel_offset", cpu_rehearsal=False, results=tmp_path / "res")
    s = rc.preset(a, str(rc.run_dir(a)))
    s.select_csr_offset = 0.01  # the arm's change comes after stage 1
    base = tmp_path / "run"
    with pytest.raises(SystemExit, match="no finished stage 1"):
        rc.share_stage1(a, s, base)
    (base / "stage1" / "final").mkdir(parents=True)
    (base / "stage1" / "final" / "DONE").write_text("ok")
    (base / "stage1" / "final" / "rnn_layers.safetensors").write_bytes(b"w")
    (base / "select").mkdir()
    (base / "select" / "results.json").write_text("{}")
    (base / "settings.json").write_text(json.dumps({**asdict(s), "seed": 7}))
    with pytest.raises(SystemExit, match="seed"):
        rc.share_stage1(a, s, base)
    (base / "settings.json").write_text(json.dumps({**asdict(s), "select_csr_offset": 1e-6}))
    rc.share_stage1(a, s, base)
    arm = tmp_path / "run_sel_offset"
    assert (arm / "stage1" / "final" / "rnn_layers.safetensors").stat().st_nlink == 2
    assert (arm / "select" / "results.json").exists() and not (arm / "stage2").exists()
    with pytest.raises(SystemExit, match="--tag"):
        rc.share_stage1(Namespace(work=tmp_path, tag=""), s, base)


def test_the_calibration_objective_reaches_the_demo_settings(tmp_path):
    s = rc.settings_for(rc.parse_args(["run", "--work", str(tmp_path), "--calib-objective",
                                       "retrieval", "--calib-lengths", "32K,64K"]))
    assert (s.calib_objective, s.calib_lengths) == ("retrieval", "32K,64K")
    s = rc.settings_for(rc.parse_args(["run", "--work", str(tmp_path)]))
    assert (s.calib_objective, s.calib_lengths) == ("loss", "")  # the preset's, unchanged
    script = (REPO / "bench" / "device_real.sh").read_text()
    assert "${CALIB_OBJECTIVE:+--calib-objective $CALIB_OBJECTIVE}" in script
