"""`halo-dist demo` at its smallest setting, end to end.

Every step runs for real (SmolLM2 teacher, Wikipedia shards, stages 1-3, selection, calibration,
NIAH, lm-eval CSR, report); only the sizes are tiny.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_tiny_runs_every_step_and_writes_the_report(tmp_path, smollm2_dir):
    out = tmp_path / "demo"
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-m", "halo_dist.cli", "demo", "--preset", "tiny", "--out", str(out)]
    # umask 027: what the folder gives the group (read) and others (nothing) is the umask's doing
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=1500,
                         preexec_fn=lambda: os.umask(0o027))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    _check_what_a_newcomer_sees(out, res.stdout)
    report = (out / "report.md").read_text()
    for section in ("## Training", "## Needle in a haystack", "## Commonsense"):
        assert section in report
    pictures = sorted(p.name for p in (out / "report").glob("*.png"))
    assert {"stage1_loss.png", "stage2_loss.png", "stage3_loss.png", "niah.png",
            "csr.png"} <= set(pictures), pictures
    assert ((out / "hypenet" / "modeling_hypenet.py").exists()
            and (out / "hypenet" / "tokenizer_config.json").exists())
    assert list((out / "stage2" / "tb").glob("events.*"))  # TensorBoard logs
    # finished stages drop their resumable checkpoints (GBs of optimizer state each)
    assert not any((out / stage / "checkpoints").exists()
                   for stage in ("stage1", "stage2", "stage3"))
    # a second invocation skips every finished step
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert again.returncode == 0 and again.stdout.count("already done") >= 8, again.stdout[-2000:]


def _check_what_a_newcomer_sees(out: Path, stdout: str) -> None:
    """The console names each stage's live log and ends with teacher vs
    student; every file and folder follows the umask (027: group-readable, nothing for others);
    hypenet/ holds stage 3's weights as hard links and its model card says the calibrated a."""
    import json

    assert "[demo] stage2           running (log logs/stage2.log)" in stdout
    assert "teacher vs student, 95% intervals" in stdout and "[demo] disk use" in stdout
    for path in [out, *out.rglob("*")]:
        mode = path.lstat().st_mode & 0o777
        assert not mode & 0o027 and mode & 0o040, f"{path}: {oct(mode)}"
    weights = "model.safetensors"
    assert ((out / "hypenet" / weights).stat().st_ino
            == (out / "stage3" / "final" / weights).stat().st_ino)
    a = json.loads((out / "calibrate.json").read_text())["chosen_a"]
    card = (out / "hypenet" / "README.md").read_text()
    assert (f"a = {a:g}" if a is not None else "no scaling") in card


def _stage_dir(root: Path, stage: str, done: bool) -> Path:
    (root / stage / "checkpoints" / "step-00000003").mkdir(parents=True)
    (root / stage / "final").mkdir()
    if done:
        (root / stage / "final" / "DONE").write_text("ok")
    return root / stage / "checkpoints"


@pytest.mark.parametrize("keep", [False, True])
def test_demo_prunes_only_finished_stages_checkpoints(tmp_path, keep):
    from halo_dist.pipeline.demo import Demo, DemoSettings

    finished, running = (_stage_dir(tmp_path, "stage1", done=True),
                         _stage_dir(tmp_path, "stage2", done=False))
    demo = Demo(DemoSettings(out=str(tmp_path), keep_checkpoints=keep))
    demo.prune_checkpoints("stage1")
    demo.prune_checkpoints("stage2")
    demo.prune_checkpoints("stage3")  # never ran: nothing to do
    assert finished.exists() == keep
    assert running.exists()  # an unfinished stage keeps what it needs to resume


def test_demo_boolean_flags_parse_both_ways():
    import argparse

    from halo_dist.pipeline.demo import add_demo_command

    parser = argparse.ArgumentParser()
    add_demo_command(parser.add_subparsers())
    assert parser.parse_args(["demo", "--keep-checkpoints"]).keep_checkpoints is True
    assert parser.parse_args(["demo", "--no-keep-checkpoints"]).keep_checkpoints is False
    assert parser.parse_args(["demo"]).keep_checkpoints is None  # the preset decides


def test_demo_help_lists_every_setting():
    res = subprocess.run([sys.executable, "-m", "halo_dist.cli", "demo", "--help"],
                         capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0
    for flag in ("--preset", "--stage2-steps", "--niah-lengths", "--csr-limit", "--out", "--pe"):
        assert flag in res.stdout


def test_deadline_stops_a_running_step_gently_and_the_next_piece_continues(tmp_path, monkeypatch):
    """At the deadline the running step gets SIGTERM (a stage saves and exits 0), the demo pauses;
    the seconds of both pieces add up in timings.json and a finished step is skipped next time."""
    import halo_dist.pipeline.demo as demo_module
    from halo_dist.pipeline.demo import Demo, DemoPaused, DemoSettings

    monkeypatch.setattr(demo_module, "STAGE_MIN_S", 1.0)  # seconds, not minutes: a 2 s deadline
    monkeypatch.setattr(demo_module, "OTHER_MIN_S", 1.0)
    saver = ("import signal, sys, time, pathlib\n"
             "def stop(*_):\n    pathlib.Path(sys.argv[1]).write_text('saved'); sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, stop)\ntime.sleep(60)\n")
    demo = Demo(DemoSettings(out=str(tmp_path), deadline_s=2.0))
    done = tmp_path / "done"
    with pytest.raises(DemoPaused, match="checkpoint saved"):
        demo.run("stage", [sys.executable, "-c", saver, str(tmp_path / "ckpt")], done, stage=True)
    assert (tmp_path / "ckpt").read_text() == "saved"
    with pytest.raises(DemoPaused, match="not started"):  # too little time left to start anything
        demo.run("next", [sys.executable, "-c", "pass"], tmp_path / "next_done")

    demo2 = Demo(DemoSettings(out=str(tmp_path)))  # the next piece, no deadline
    finish = f"import pathlib; pathlib.Path({str(done)!r}).write_text('ok')"
    demo2.run_together([("stage", [sys.executable, "-c", finish], done),
                        ("other", [sys.executable, "-c", "pass"], tmp_path / "other_done")])
    # done: skipped, not run
    demo2.run("stage", [sys.executable, "-c", "raise SystemExit(9)"], done)
    import json

    timings = json.loads((tmp_path / "timings.json").read_text())
    assert timings["stage"] >= 2.0 and "stage + other" in timings, timings
    assert "$ " in (tmp_path / "logs" / "stage.log").read_text()


@pytest.mark.slow
def test_background_step_runs_alongside_and_its_failure_or_pause_is_reported(tmp_path, monkeypatch):
    """The teacher's evaluation (``teacher_eval: with-stages``) runs while the stages do: a
    foreground step finishes while it runs; join waits for it and records its window; a failed one
    stops the demo with its log; at the deadline it is stopped and the next piece starts it
    again."""
    import json

    import halo_dist.pipeline.demo as demo_module
    from halo_dist.pipeline.demo import Demo, DemoPaused, DemoSettings, DemoStepError

    demo = Demo(DemoSettings(out=str(tmp_path)))
    done = tmp_path / "bg_done"
    slow = f"import pathlib, time; time.sleep(1.5); pathlib.Path({str(done)!r}).write_text('ok')"
    import time

    t0 = time.time()
    demo.start_background("bg", [sys.executable, "-c", slow], done)
    demo.run("fg", [sys.executable, "-c",
                    f"import pathlib; pathlib.Path({str(tmp_path / 'fg')!r}).write_text('ok')"],
             tmp_path / "fg")
    assert not done.exists()  # the foreground step did not wait for the background one
    demo.run("fg2", [sys.executable, "-c", "import time; time.sleep(4)"], tmp_path / "fg2_done")
    time.sleep(1.0)
    demo.join_background()
    assert done.exists() and not demo.background
    window = json.loads((tmp_path / "background.json").read_text())[-1]
    # the window ends when the step exited (noticed during fg2), not when join_background looked
    assert (window["name"] == "bg" and 1.4 <= window["end"] - window["start"] < 3.5
            and window["start"] >= t0)
    # done: not started
    demo.start_background("bg", [sys.executable, "-c", "raise SystemExit(5)"], done)
    assert not demo.background

    demo.start_background("bad", [sys.executable, "-c", "print('boom'); raise SystemExit(7)"],
                          tmp_path / "never")
    with pytest.raises(DemoStepError, match=r"step bad failed \(exit 7\)(.|\n)*boom"):
        demo.join_background()

    monkeypatch.setattr(demo_module, "STOP_GRACE_S", 5.0)
    paused = Demo(DemoSettings(out=str(tmp_path), deadline_s=1.0))
    paused.start_background("long", [sys.executable, "-c", "import time; time.sleep(60)"],
                            tmp_path / "long_done")
    proc = paused.background["long"][0]
    with pytest.raises(DemoPaused, match="stopped long"):
        paused.join_background()
    assert proc.poll() is not None and not paused.background  # stopped, not left running

    leftover = Demo(DemoSettings(out=str(tmp_path)))
    leftover.start_background("orphan", [sys.executable, "-c", "import time; time.sleep(60)"],
                              tmp_path / "o_done")
    proc = leftover.background["orphan"][0]
    leftover.stop_background()  # what main() does when a step fails or the demo pauses
    assert proc.poll() is not None
    names = [w["name"] for w in json.loads((tmp_path / "background.json").read_text())]
    assert names == ["bg", "bad", "long", "orphan"]


def test_pe_setting_reaches_the_stage1_and_stage2_launchers_only(tmp_path):
    """--pe all_rope (the HyPE ablation) is stages 1-2's model.pe; stage 3 inherits the stage-2
    folder's."""
    from halo_dist.config import load_config
    from halo_dist.pipeline.demo import Demo, DemoSettings, DemoStepError

    stages = ("stage1", "stage2", "stage3")
    demo = Demo(DemoSettings(out=str(tmp_path), pe="all_rope"))
    given = {stage: [a for a in demo.launcher(stage) if a.startswith("model.pe=")]
             for stage in stages}
    assert given == {"stage1": ["model.pe=all_rope"], "stage2": ["model.pe=all_rope"], "stage3": []}
    cmd = demo.launcher("stage2")
    config_at = cmd.index("--config") + 1
    loaded = load_config(cmd[config_at], cmd[config_at + 1:])
    assert loaded.model.pe == "all_rope"  # the launcher accepts it
    # RoPE attention trains as the teacher's did, unscaled
    assert loaded.model.logits_scaling_a is None
    default = Demo(DemoSettings(out=str(tmp_path)))
    assert not [a for stage in stages for a in default.launcher(stage) if a.startswith("model.pe=")]
    with pytest.raises(DemoStepError, match="--pe 'rope': choose one of hype, all_rope, all_nope"):
        Demo(DemoSettings(pe="rope"))


def test_teacher_eval_setting_is_validated():
    from halo_dist.pipeline.demo import Demo, DemoSettings, DemoStepError

    with pytest.raises(DemoStepError, match="--teacher-eval 'later'"):
        Demo(DemoSettings(teacher_eval="later"))
    assert (DemoSettings.h200("x").teacher_eval == "with-stages"
            and DemoSettings.tiny("x").teacher_eval == "at-end")


def test_loss_backend_setting_reaches_the_kl_stages_only(tmp_path):
    from halo_dist.config import load_config
    from halo_dist.pipeline.demo import Demo, DemoSettings

    demo = Demo(DemoSettings(out=str(tmp_path), loss_backend="compiled"))
    given = {st: [a for a in demo.launcher(st) if a.startswith("loss.backend=")]
             for st in ("stage1", "stage2", "stage3")}
    assert given == {"stage1": [], "stage2": ["loss.backend=compiled"],
                     "stage3": ["loss.backend=compiled"]}
    cmd = demo.launcher("stage3")
    assert load_config(cmd[cmd.index("--config") + 1],
                       cmd[cmd.index("--config") + 2:]).loss.backend == "compiled"


def test_stages_skip_the_final_checkpoint_the_demo_would_delete(tmp_path):
    """Checkpoints are pruned once a stage's export exists, so the stages write no final one unless
    kept."""
    from halo_dist.config import load_config
    from halo_dist.pipeline.demo import Demo, DemoSettings

    for keep, expected in ((False, False), (True, True)):
        cmd = Demo(DemoSettings(out=str(tmp_path), keep_checkpoints=keep)).launcher("stage2")
        assert load_config(cmd[cmd.index("--config") + 1],
                           cmd[cmd.index("--config") + 2:]).checkpoint.save_final is expected


def test_teacher_eval_none_evaluates_only_the_student(tmp_path):
    from halo_dist.pipeline.demo import Demo, DemoSettings

    steps = Demo(DemoSettings(out=str(tmp_path),
                              teacher_eval="none")).final_evals("TEACHER", "STUDENT", "DATA")
    assert [name for name, _, _ in steps] == ["eval-student"]


def test_given_attention_layers_skip_the_selection_and_bad_ones_are_refused(tmp_path):
    """--attn-layers (an ablation keeping another run's layers) skips select-layers; a list that
    stage 2 would refuse minutes later is refused before anything runs."""
    from halo_dist.pipeline.demo import Demo, DemoSettings, DemoStepError

    demo = Demo(DemoSettings(out=str(tmp_path), num_attn=3, attn_layers="19,7,18"))
    assert demo.attention_layers("TEACHER", "DATA") == [7, 18, 19]
    assert not (tmp_path / "logs").exists()  # no step ran
    for bad, why in (("7,18", "expected 3 distinct"), ("7,7,18", "expected 3 distinct"),
                     ("7,18,30", "0..29"), ("7;18;19", "comma-separated")):
        with pytest.raises(DemoStepError, match=why):
            Demo(DemoSettings(out=str(tmp_path), num_attn=3, attn_layers=bad))


def test_a_step_that_finished_as_the_deadline_came_counts_as_done(tmp_path, monkeypatch):
    """SIGTERM at the deadline reached a stage after its last step and export (it wrote DONE and
    exited 0): the demo goes on to the next step instead of reporting a pause."""
    import halo_dist.pipeline.demo as demo_module
    from halo_dist.pipeline.demo import Demo, DemoSettings

    monkeypatch.setattr(demo_module, "STAGE_MIN_S", 0.5)
    done = tmp_path / "DONE"
    finisher = ("import signal, sys, time, pathlib\n"
                "def stop(*_):\n    pathlib.Path(sys.argv[1]).write_text('ok'); sys.exit(0)\n"
                "signal.signal(signal.SIGTERM, stop)\ntime.sleep(60)\n")
    Demo(DemoSettings(out=str(tmp_path), deadline_s=1.0)).run("stage", [sys.executable, "-c",
                                                                        finisher, str(done)],
                                                              done, stage=True)
    assert done.read_text() == "ok"


def test_split_student_evaluation_runs_niah_and_csr_as_two_suites_with_their_own_markers(tmp_path):
    """split_student_eval: the student's NIAH and its CSR + perplexity run as two processes into one
    folder; each part is asked of exactly one of them and each writes its own marker. The h200
    preset (the teacher ran alongside the stages) keeps one suite: on one GPU NIAH's decode beside
    CSR's batches is slow."""
    from halo_dist.pipeline.demo import Demo, DemoSettings

    settings = DemoSettings.h200(str(tmp_path))
    assert ([name for name, _, _ in Demo(settings).final_evals("TEACHER", "STUDENT", "DATA")]
            == ["eval-student"])
    settings.split_student_eval = True
    steps = Demo(settings).final_evals("TEACHER", "STUDENT", "DATA")
    assert [name for name, _, _ in steps] == ["eval-student-niah", "eval-student-csr"]

    def flag(cmd, name):
        return cmd[cmd.index(name) + 1] if name in cmd else None

    (_, niah, niah_done), (_, csr, csr_done) = steps
    assert (flag(niah, "--niah-lengths") == "2K,4K,8K,16K,32K,64K"
            and flag(niah, "--csr-tasks") == "")
    assert (flag(niah, "--ppl-data") is None
            and flag(niah, "--done-marker") == "DONE.niah" == niah_done.name)
    assert flag(csr, "--niah-lengths") == "" and "winogrande" in flag(csr, "--csr-tasks")
    assert (flag(csr, "--ppl-data") == "DATA"
            and flag(csr, "--done-marker") == "DONE.csr" == csr_done.name)
    assert niah_done.parent == csr_done.parent == tmp_path.resolve() / "eval" / "student"
    together = Demo(DemoSettings(out=str(tmp_path))).final_evals("TEACHER", "STUDENT", "DATA")
    assert [name for name, _, _ in together] == ["eval-student", "eval-teacher"]


def test_pause_after_a_step_ends_the_piece_there_and_names_are_checked(tmp_path):
    """--pause-after ends a piece once that step has run (not when it was already done), so a piece
    can end between stages; an unknown step name is refused up front, not ignored."""
    from halo_dist.pipeline.demo import Demo, DemoPaused, DemoSettings, DemoStepError

    demo = Demo(DemoSettings(out=str(tmp_path), pause_after="select-layers"))
    done = tmp_path / "selection.json"
    demo.run("stage1", [sys.executable, "-c", "pass"], tmp_path / "s1")  # another step: no pause
    with pytest.raises(DemoPaused, match="paused after select-layers"):
        demo.run("select-layers", [sys.executable, "-c", f"open({str(done)!r}, 'w').write('{{}}')"],
                 done)
    # done: skipped, no pause
    demo.run("select-layers", [sys.executable, "-c", "raise SystemExit(9)"], done)
    # a background step still running when the pause comes finishes first instead of being stopped
    slow = tmp_path / "background_done"
    demo = Demo(DemoSettings(out=str(tmp_path), pause_after="stage2"))
    demo.start_background("eval-teacher", [sys.executable, "-c", "import time; time.sleep(2); "
                                                                 f"open({str(slow)!r}, 'w')"], slow)
    with pytest.raises(DemoPaused, match="paused after stage2"):
        demo.run("stage2", [sys.executable, "-c", "pass"], tmp_path / "s2")
    assert slow.exists() and not demo.background
    with pytest.raises(DemoStepError, match="--pause-after 'select'"):
        Demo(DemoSettings(out=str(tmp_path), pause_after="select"))


def test_cpu_steps_that_run_at_once_share_the_threads(tmp_path, monkeypatch):
    """On a CPU demo, steps running at the same time split OMP_NUM_THREADS (oversubscribed OpenMP
    threads spin against each other); a background step counts until it exits; on a GPU the user's
    setting stays."""
    from halo_dist.pipeline.demo import Demo, DemoSettings

    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    demo = Demo(DemoSettings(out=str(tmp_path), device="cpu"))
    assert demo.cpu_threads(1) == 4 and demo.cpu_threads(2) == 2 and demo.cpu_threads(8) == 1
    show = [sys.executable, "-c", "import os; print('threads', os.environ['OMP_NUM_THREADS'])"]
    demo.start_background("bg", [sys.executable, "-c",
                                 "import os, time; print('threads', os.environ['OMP_NUM_THREADS'], "
                                 "flush=True); time.sleep(30)"], tmp_path / "never")
    assert demo.cpu_threads(1) == 2  # the background step is still running
    demo.run_together([("a", show, tmp_path / "a.done"), ("b", show, tmp_path / "b.done")])
    demo.stop_background()
    assert demo.cpu_threads(1) == 4
    logs = {n: (tmp_path / "logs" / f"{n}.log").read_text() for n in ("bg", "a", "b")}
    assert "threads 2" in logs["bg"] and "threads 1" in logs["a"] and "threads 1" in logs["b"], logs
    assert Demo(DemoSettings(out=str(tmp_path), device="cuda")).cpu_threads(2) is None


def test_stage2_context_keeps_the_tokens_per_step_and_other_stages_untouched(tmp_path):
    """--stage2-seq-len (stage 2 at a context where the teacher retrieves): 4x longer rows, 4x
    fewer of them, the same tokens per step; stages 1 and 3 keep theirs; a context that does not
    divide a step's tokens is refused before anything runs."""
    from halo_dist.pipeline.demo import Demo, DemoSettings, DemoStepError

    s = DemoSettings.h200(str(tmp_path))
    s.stage2_seq_len = 2048
    demo = Demo(s)
    assert demo.stage2_shape() == (2048, 32, 32)
    args = demo.launcher("stage2")
    assert "data.global_batch_size=32" in args and "data.micro_batch_size=32" in args
    assert "data.global_batch_size=128" in demo.launcher("stage1")
    s.stage2_seq_len = 3000
    with pytest.raises(DemoStepError, match="--stage2-seq-len 3000"):
        Demo(s)


def test_stage3_data_reaches_stage3_alone(tmp_path):
    """--stage3-data (long documents mixed with synthetic retrieval ones): stage 3 trains on it;
    stages 1-2 keep --data and the calibration keeps --data-long."""
    from halo_dist.pipeline.demo import Demo, DemoSettings

    data = {name: tmp_path / name for name in ("all", "long", "long_retrieval")}
    for folder in data.values():
        folder.mkdir()
    s = DemoSettings(out=str(tmp_path / "out"), data=str(data["all"]), data_long=str(data["long"]),
                     stage3_data=str(data["long_retrieval"]))
    demo = Demo(s)
    assert f"data.train={data['long_retrieval']}" in demo.launcher("stage3")
    for stage in ("stage1", "stage2"):
        assert f"data.train={data['all']}" in demo.launcher(stage)


def test_demo_help_lists_the_choices_and_every_presets_real_defaults():
    """No empty default in ``--help``; the fixed sets are listed and enforced."""
    import argparse

    from halo_dist.pipeline.demo import add_demo_command

    parser = argparse.ArgumentParser()
    add_demo_command(parser.add_subparsers())
    demo = parser._subparsers._group_actions[0].choices["demo"]
    text = " ".join(demo.format_help().split())
    for listed in ("--pe {hype,all_rope,all_nope,attn_rope_rnn_nope}",
                   "--compile {none,mlp,layer}", "--teacher-eval {at-end,with-stages,none}"):
        assert listed in text, listed
    assert "(default: 256; presets tiny: 64, h200: 512)" in text  # --seq-len
    assert "default: hype" in text and "default: )" not in text and "default )" not in text
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--compile", "everything"])
    assert parser.parse_args(["demo", "--pe", ""]).pe == ""  # empty: the default's meaning


def test_a_missing_data_folder_is_refused_before_any_step(tmp_path):
    from halo_dist.pipeline.demo import Demo, DemoSettings
    from halo_dist.pipeline.steps import DemoStepError

    for flag, setting in (("--data", "data"), ("--data-long", "data_long"),
                          ("--stage3-data", "stage3_data")):
        missing = tmp_path / "no_such_shards"
        with pytest.raises(DemoStepError, match=f"{flag} {missing} does not exist.*data_prep"):
            Demo(DemoSettings(out=str(tmp_path / "out"), **{setting: str(missing)}))


def test_the_exported_student_shares_stage3s_files_and_calibration_leaves_stage3_intact(tmp_path):
    """``hypenet/`` is stage 3's export as hard links (one copy of the model on
    disk, counted once), and calibration's rewrite of its config.json leaves stage 3's alone."""
    from halo_dist.pipeline.demo import Demo, DemoSettings
    from halo_dist.pipeline.report import disk_use
    from halo_dist.eval.calibrate import write_scale_base

    final = tmp_path / "stage3" / "final"
    final.mkdir(parents=True)
    (final / "model.safetensors").write_bytes(b"\0" * 1_000_000)
    (final / "config.json").write_text('{"attn_logits_scale_base": 500.0}')
    student = Demo(DemoSettings(out=str(tmp_path))).export_student()
    assert student == tmp_path / "hypenet"
    weights = student / "model.safetensors"
    assert weights.stat().st_ino == (final / "model.safetensors").stat().st_ino
    assert student.stat().st_mode == final.stat().st_mode  # the umask's, as stage 3 wrote it
    write_scale_base(student, 50.0)
    assert '"attn_logits_scale_base": 50.0' in (student / "config.json").read_text()
    assert (final / "config.json").read_text() == '{"attn_logits_scale_base": 500.0}'
    assert 1_000_000 <= disk_use(tmp_path) < 1_100_000  # the weights once, not twice


# ------------------------------------------------------------------ the console
FAKE_STAGE = """
import json, sys, time
from pathlib import Path
folder = Path(sys.argv[1]); folder.mkdir(parents=True, exist_ok=True)
with open(folder / "metrics.jsonl", "a") as f:
    for step in (1, 2):
        f.write(json.dumps({"step": step, "time": 100.0 + 20 * step, "train/loss": 4.0 / step,
                            "perf/tokens_per_s": 1234.0}) + "\\n")
        f.flush()
        time.sleep(1.6)
"""


def test_a_running_stage_shows_its_log_and_a_progress_line(tmp_path, capsys, monkeypatch):
    """While a stage runs the console names its live log and shows its step, loss, tokens/s and
    ETA from the stage's metrics.jsonl (here at most every 0.5 s: not a terminal)."""
    from halo_dist.pipeline import progress as demo_progress
    from halo_dist.pipeline.demo import Demo, DemoSettings

    monkeypatch.setattr(demo_progress, "EVERY_S", 0.5)
    demo = Demo(DemoSettings(out=str(tmp_path), stage1_steps=3))
    demo.run("stage1", [sys.executable, "-c", FAKE_STAGE, str(tmp_path / "stage1")],
             tmp_path / "never", stage=True)
    out = capsys.readouterr().out
    assert "[demo] stage1           running (log logs/stage1.log)" in out
    assert "step 2/3 | loss 2 | 1.23K tok/s | ETA 20s" in out, out
    assert out.rstrip().splitlines()[-1].startswith("[demo] stage1           done in")


def test_the_progress_line_is_rewritten_on_a_terminal_and_rate_limited_elsewhere():
    import io

    from halo_dist.pipeline.progress import ProgressLine

    now = [0.0]
    piped = io.StringIO()
    line = ProgressLine("[demo] x ", piped, every_s=60.0, clock=lambda: now[0])
    for t, text in ((10.0, "step 1/9"), (61.0, "step 2/9"), (62.0, "step 3/9"), (130.0, "step 3/9"),
                    (131.0, "step 4/9")):
        now[0] = t
        line.show(text)
    # the latest figures once a minute has passed since the last printed line, never a repeat
    assert piped.getvalue() == "[demo] x step 2/9\n[demo] x step 3/9\n"

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty = Terminal()
    line = ProgressLine("[demo] x ", tty, clock=lambda: 0.0)
    line.show("step 1/9")
    line.show("step 2/9")
    line.end()
    assert tty.getvalue() == ("\r\x1b[K[demo] x step 1/9\r\x1b[K[demo] x step 2/9\r\x1b[K")


def test_the_end_of_the_demo_says_teacher_vs_student_with_n_and_what_the_budget_means(tmp_path):
    from test_pictures import fake_run

    from halo_dist.pipeline.report import (REAL_RESULTS, console_summary, scorecard_of,
                                           stage_budget, write_report)

    out = fake_run(tmp_path / "demo", "tiny")
    budget = stage_budget(out)
    assert budget == {"stage1": (12, 6144), "stage2": (14, 7168), "stage3": (3, 1536)}
    lines = console_summary(scorecard_of(out), budget)
    assert len(lines) == 5, lines
    assert ("teacher 20.0 [18.0-22.0], student 2,300.0 [2,070.0-2,530.0] (n = 8 rows x 256"
            in lines[1])
    assert "CSR, mean of 3 tasks" in lines[2] and "(n = 4 items per task)" in lines[2]
    assert "NIAH" in lines[3] and "n=3" in lines[3]  # three tasks x one prompt inside the haystack
    assert "14,848 tokens" in lines[4] and "expected" in lines[4]
    report = write_report(out, [1, 2], 60.0).read_text()
    assert "stage1 6,144 (12 steps), stage2 7,168 (14 steps), stage3 1,536 (3 steps)" in report
    assert "word salad" in report and REAL_RESULTS in report
    title = REAL_RESULTS.split('"')[1]
    assert f"## {title}" in (REPO / "README.md").read_text()  # the pointer leads somewhere


def test_readme_states_the_default_presets_token_budget():
    """README's "What the demo's student looks like" says what the default preset trains."""
    from halo_dist.pipeline.report import preset_tokens

    readme = (REPO / "README.md").read_text()
    assert f"The default preset trains {preset_tokens('default'):,} tokens" in readme
