"""A real conversion on one H200: SmolLM2-135M becomes a HypeNet, and its quality is measured.

The whole HALO pipeline of ``halo-dist demo --preset h200`` on a >=100M-token offline corpus
(``bench/build_corpus.py``), then the prefill/decode speed of the real pair, then one results file:

  corpus   bench/build_corpus.py build: carried natural text + this machine's Python sources
           -> shards (``all`` for stages 1-2, layer selection and perplexity; ``long`` for stage 3
           and calibration)
  demo     teacher -> stage 1 (20M tokens) -> layer selection -> stage 2 (60M) -> stage 3 at 16K
           (10M) -> calibration of a -> export -> NIAH 2K-64K, the five CSR sets, held-out
           perplexity
  speed    bench/bench_inference.py --real: prefill and decode of teacher vs student at 8K-128K
  collect  bench/results/real_conversion.json + PNGs (curves, NIAH heatmaps side by side, CSR bars)

Every part skips what is done, so ``run`` resumes where it stopped. ``--deadline-s`` cuts it into
pieces (each GPU command here may run 10 minutes): at the deadline the running stage checkpoints,
the script exits with code 3, and the same command continues in the next piece.

``--pause-after STEP`` ends a piece between two steps instead (no stage then pays a resume), when
the piece lengths are known from an earlier run.

``warmup`` runs stage 2 for a few steps with a random teacher of SmolLM2's shape and family (it
autotunes fla's kernels and fills the compile caches) before the real teacher is on the machine; it
chooses ``model.compile`` for stage 2: ``layer``, unless the compiled warm-up failed.

  python bench/real_conversion.py warmup --data /tmp/halo/corpus/all --work /tmp/halo
  python bench/real_conversion.py run --text .xfer/text --tokenizer .xfer/tokenizer \\
      --work /tmp/halo --deadline-s 560
  python bench/real_conversion.py collect --work /tmp/halo
  # every part on CPU at the demo's tiny sizes
  python bench/real_conversion.py run ... --cpu-rehearsal
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import RESULTS, environment  # noqa: E402
# the names the script defined before its parts moved to bench/real/ stay importable from here (the
# tests read them as ``real_conversion.X``)
from bench.real.compare import (NIAH_TASKS, ablation_table, cmd_compare,  # noqa: E402,F401
                                cmd_compare_runs)
from bench.real.pictures import pictures  # noqa: E402
from bench.real.opd_arm import ARMS, arm_demo  # noqa: E402
from bench.real.run_folder import (STAGE1_SETTINGS, align_teacher_tokenizer,  # noqa: E402,F401
                                   check_same_pe, hype_twin, record_piece, run_dir, share_stage1,
                                   share_stage3)
from bench.real.summary import (NIAH_LENGTHS, goals, gpu_minutes, headline,  # noqa: E402,F401
                                result_stem, sharing_rates, stage_summary, summarize)
from halo_dist.config import PE_ROPE  # noqa: E402
from halo_dist.pipeline.demo import TEACHER_EVAL_CHOICES, Demo, DemoPaused, DemoSettings  # noqa: E402

SPEED_CONTEXTS = "8192,16384,32768,65536,131072"
PAUSED = 3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("corpus", "prompts", "warmup", "run", "collect", "compare", "compare-runs"):
        c = sub.add_parser(name)
        c.add_argument("--work", type=Path, required=True,
                       help="work folder: corpus/, run/, warmup.json")
        c.add_argument("--cpu-rehearsal", action="store_true",
                       help="the demo's tiny sizes on CPU (checks the script)")
    _warmup_args(sub.choices["warmup"])
    _corpus_args(sub.choices["corpus"])
    sub.choices["prompts"].add_argument("--tokenizer", type=Path, required=True,
                                        help="SmolLM2's tokenizer folder (the corpus's)")
    _run_args(sub.choices["run"])
    for name in ("run", "collect"):
        sub.choices[name].add_argument(
            "--tag", default="", help="an experiment's name: its results go to "
            "real_conversion_<tag>.json, beside the baseline's (compare them with compare-runs)")
    _compare_args(sub.choices["compare"], sub.choices["compare-runs"])
    for c in sub.choices.values():
        c.add_argument("--results", type=Path, default=RESULTS,
                       help="where real_conversion.json and PNGs go")
    return p.parse_args(argv)


def _warmup_args(w: argparse.ArgumentParser) -> None:
    w.add_argument("--data", type=Path, required=True,
                   help="token shards made with SmolLM2's tokenizer")
    w.add_argument("--steps", type=int, default=6, help="stage-2 steps")


def _corpus_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("--text", type=Path, required=True,
                   help="carried natural text (bench/build_corpus.py pack --out)")
    c.add_argument("--tokenizer", type=Path, required=True,
                   help="SmolLM2's tokenizer folder (copied to WORK/tokenizer)")
    c.add_argument("--num-proc", type=int, default=os.cpu_count() or 2, help="tokenizer processes")
    c.add_argument("--retrieval-docs", type=int, default=0,
                   help="also build corpus/long_retrieval: long plus this many synthetic retrieval "
                        "documents (build_corpus.py --retrieval-docs; the stage-3 data of an "
                        "experiment, --stage3-data long_retrieval)")


def _run_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("--deadline-s", type=float, default=0.0,
                   help="pause after this many seconds (0: none)")
    r.add_argument("--pause-after", default="",
                   help="end this piece once that step has run (e.g. select-layers)")
    r.add_argument("--compile", choices=("auto", "none", "mlp", "layer"), default="auto",
                   help="model.compile of stage 2; auto: warmup.json's choice, else layer")
    r.add_argument("--pe", choices=("", *PE_ROPE), default="",
                   help="model.pe of stages 1-2 (empty: hype); all_rope keeps the teacher's "
                        "attention RoPE, the HyPE ablation. The results record it (pe) and go to "
                        "real_conversion_<pe>.json / _*.png")
    r.add_argument("--attn-layers", default="",
                   help="keep these attention layers instead of selecting them (an "
                        "ablation keeps the HyPE run's: only --pe then differs)")
    r.add_argument("--loss-backend", choices=("", "auto", "torch", "compiled"), default="",
                   help="loss.backend of stages 2-3 (empty: the configs'); see warmup's "
                        "kl_smollm2.json")
    r.add_argument("--teacher-eval", choices=("", *TEACHER_EVAL_CHOICES), default="",
                   help="empty: the preset's (with-stages); none: the teacher's figures come from "
                        "another run")
    r.add_argument("--seed", type=int, default=None,
                   help="training seed of stages 1-3 (default: the preset's); the results file "
                        "then names it (real_conversion_seed<N>.json)")
    r.add_argument("--stage2-seq-len", type=int, default=None,
                   help="stage 2's context (default: the preset's 512); the rows per step shrink "
                        "to keep its tokens per step")
    r.add_argument("--stage3-data", default="",
                   help="the corpus set stage 3 trains on (default: long; long_retrieval: with the "
                        "synthetic retrieval documents of corpus --retrieval-docs); calibration "
                        "keeps long")
    r.add_argument("--select-csr-offset", type=float, default=None,
                   help="added to each layer's CSR drop in the selection score (default: the "
                        "preset's 1e-6, the paper's)")
    r.add_argument("--calib-objective", choices=("", "loss", "retrieval"), default="",
                   help="what calibration of a minimizes (default: the preset's held-out loss at "
                        "16K; retrieval: the answer NLL of facts recalled at --calib-lengths)")
    r.add_argument("--calib-lengths", default="",
                   help="prompt lengths of --calib-objective retrieval (e.g. 32K,64K; default: "
                        "the preset's --long-seq-len)")
    r.add_argument("--share-stage1-from", default="", metavar="RUN",
                   help="an experiment (--tag) that changes nothing before stage 2 starts from the "
                        "stage 1 and per-layer selection results of the run folder RUN in the same "
                        "--work (run: the baseline; run_<tag>: an experiment) on this machine, "
                        "its settings checked: two arms fit one device session")
    r.add_argument("--share-stage3-from", default="", metavar="RUN",
                   help="an experiment (--tag) that changes nothing before calibration starts "
                        "from the finished stages 1-3 of the run folder RUN in the same --work "
                        "(its settings checked): the OPD arms, or a calibration change")
    r.add_argument("--opd-arm", choices=("", *ARMS), default="",
                   help="experiment d (bench/real/opd_arm.py): continue stage 3 by on-policy "
                        "distillation (opd) or by its teacher-forced control of as many tokens on "
                        "the same prompts (teacher_forced), then calibrate and evaluate; with "
                        "--tag, and --share-stage3-from so that both arms start from one stage 3")
    r.add_argument("--speed", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the pair's prefill and decode speed after the evaluations (a "
                        "recipe change does not change it: --no-speed saves ~1 GPU-minute)")


def _compare_args(c: argparse.ArgumentParser, runs: argparse.ArgumentParser) -> None:
    c.add_argument("--pe", choices=tuple(k for k in PE_ROPE if k != "hype"), default="all_rope",
                   help="the ablation arm compared with the HyPE run (both results files must "
                        "exist)")
    runs.add_argument("--base", type=Path, required=True,
                      help="results file of the baseline run (real_conversion*.json)")
    runs.add_argument("--arm", type=Path, required=True,
                      help="results file of the run with one change")


# ------------------------------------------------------------------------------------------- corpus
def cmd_corpus(a) -> int:
    """Shards from the carried text and this machine's Python sources, tokenized with SmolLM2's
    tokenizer (kept in WORK/tokenizer: the teacher folder built later is checked against it)."""
    tok = a.work / "tokenizer"
    if not tok.exists():
        shutil.copytree(a.tokenizer, a.work / ".tokenizer.tmp", dirs_exist_ok=True)
        os.replace(a.work / ".tokenizer.tmp", tok)
    cmd = [sys.executable, str(ROOT / "bench" / "build_corpus.py"), "build", "--text", str(a.text),
           "--tokenizer", str(tok), "--out", str(a.work / "corpus"), "--num-proc", str(a.num_proc),
           # 2% of the documents: enough natural-language text to evaluate on (a rehearsal's few
           # need more)
           "--heldout-fraction", "0.3" if a.cpu_rehearsal else "0.02", "--retrieval-docs",
           str(a.retrieval_docs)]
    # on the GPU machine: every Python source its interpreter has; a CPU rehearsal takes this repo's
    # alone
    cmd += ["--code-root", str(ROOT / "halo_dist")] if a.cpu_rehearsal else ["--code-from-python"]
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode


def corpus_done(work: Path) -> bool:
    return (work / "corpus" / "corpus_report.json").exists()


def preset(a, out: str) -> DemoSettings:
    """The demo preset this script runs (h200, or tiny for a CPU rehearsal), its NIAH prompts in the
    work folder, where every run of it (the baseline's and each experiment's) reads them."""
    s = DemoSettings.tiny(out) if a.cpu_rehearsal else DemoSettings.h200(out)
    s.niah_prompts = str(a.work / "niah_prompts")
    return s



# ------------------------------------------------------------------------------------------ prompts
def cmd_prompts(a) -> int:
    """The run's NIAH prompts (every task, length, depth and sample of the preset), built on the CPU
    beside the corpus: teacher and student read them instead of tokenizing ~7M haystack tokens each
    inside the timed run.
    The teacher folder later takes this tokenizer's files if it serialises differently
    (``align_teacher_tokenizer``), so the prompts' tokenizer key matches it."""
    s = preset(a, str(a.work / "run"))
    cmd = Demo(s).niah_prompts_cmd(str(a.tokenizer))
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode


# ------------------------------------------------------------------------------------------- warmup
def cmd_warmup(a) -> int:
    """Stage 2 through bench_stages on the real config with a random SmolLM2-shape (Llama) teacher:
    it autotunes fla's forward and backward kernels (the RNN layers of every stage) and fills the
    compile caches for the compiled stage-2 layers, training and held-out evaluation; profiles its
    last two steps (warmup_runs/stage2_warmup/profile/); writes warmup.json."""
    out = a.work / "warmup.json"
    if out.exists():
        print(f"warmup: already done ({out})")
        return 0
    # the stage-2 config compiles its layers (model.compile=layer); the tiny CPU one does not
    pattern = ("configs/tiny/stage{stage}.yaml" if a.cpu_rehearsal
               else "configs/bench/stage{stage}_smollm2.yaml")
    s = preset(a, "")
    cmd = [sys.executable, str(ROOT / "bench" / "bench_stages.py"), "--data", str(a.data),
           "--no-naive", "--stages", "2", "--config-pattern", pattern, "--steps", "1", str(a.steps),
           "1", "--runs", str(a.work / "warmup_runs"), "--stage2-micro", str(s.micro_batch),
           "--stage2-batch", str(s.global_batch), "--checkpointing", "off",
           "--log-every", "2", "--tag", "_warmup", "--out", str(a.work / "warmup_stages.json"),
           # where a step of this small model spends its time (host launches vs GPU), after
           # compilation
           "--extra", f"logging.profile_at_step={max(1, a.steps - 1)}", "logging.profile_steps=2"]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=False)
    stages = (json.loads((a.work / "warmup_stages.json").read_text())
              if (a.work / "warmup_stages.json").exists() else {})
    ok = stages.get("stage2", {}).get("status") == "ok"
    if a.cpu_rehearsal:
        choice = {"compile": "none", "why": "CPU rehearsal: eager"}
    else:
        choice = {"compile": "layer" if ok else "none",
                  "why": "the compiled stage 2 ran in the warm-up" if ok
                  else "the compiled warm-up stage 2 failed: eager"}
    try:  # a failure here costs the run only the autotuning it would have saved
        inference = warm_inference_kernels(small=a.cpu_rehearsal)
    except Exception as e:  # noqa: BLE001
        inference = {"error": repr(e)}
    print(f"inference kernels: {inference}", flush=True)
    out.write_text(json.dumps({**choice, "stages": stages, "inference_kernels": inference,
                               "environment": environment()}, indent=2, default=str))
    print(json.dumps(choice))
    return 0


def warm_inference_kernels(small: bool = False) -> dict:
    """The Lightning kernel variants that training does not run but the selection and the student's
    evaluation do, called once each at SmolLM2's head shape so that fla autotunes them here rather
    than inside the timed run (without a carried autotuning cache, the selection's first layer spent
    ~40 s on the H200): forward-only chunks with a per-token gate (right-padded batches:
    lm-eval's CSR, the recall probe) and with the head-constant decay (left padding from an empty
    state: NIAH prefill), and one decode step of each, for the batch sizes those steps use (fla's
    cumulative-sum kernels autotune per batch size)."""
    import torch

    from halo_dist.models.hypenet.ops_rnn import lightning_attention

    device = "cuda" if torch.cuda.is_available() and not small else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    H, D, T = 9, 64, 256 if device == "cuda" else 16
    log_decay = -torch.linspace(0.01, 0.5, H)
    t0, calls = time.time(), 0
    with torch.no_grad():
        for B in (1, 4, 5, 16, 64, 128):
            q, k, v = (torch.randn(B, T, H, D, device=device, dtype=dtype) for _ in range(3))
            right = torch.ones(B, T, dtype=torch.bool, device=device)
            right[0, T // 2:] = False  # a pad after real tokens: per-token gate
            left = torch.ones_like(right)
            left[0, :T // 2] = False  # padding before the prompt, empty state: head-constant decay
            for mask in (right, left, None):
                _, state = lightning_attention(q, k, v, log_decay, D ** -0.5, token_mask=mask)
                step = None if mask is None else mask[:, -1:]
                lightning_attention(q[:, -1:], k[:, -1:], v[:, -1:], log_decay, D ** -0.5,
                                    token_mask=step, initial_state=state, decode=True)
                calls += 2
    if device == "cuda":
        torch.cuda.synchronize()
    return {"device": device, "calls": calls, "seconds": round(time.time() - t0, 1)}


# ---------------------------------------------------------------------------------------------- run
def settings_for(a) -> DemoSettings:
    s = preset(a, str(run_dir(a)))
    s.data, s.data_long = str(a.work / "corpus" / "all"), str(a.work / "corpus" / "long")
    if a.cpu_rehearsal:
        s.config_dir = "configs/demo"
    s.teacher_eval = "with-stages"  # the h200 schedule, rehearsed on CPU too
    compile_ = a.compile
    if compile_ == "auto":
        warm = a.work / "warmup.json"
        compile_ = (json.loads(warm.read_text())["compile"] if warm.exists()
                    else ("none" if a.cpu_rehearsal else "layer"))
    s.compile = compile_
    s.pe = a.pe
    s.attn_layers = a.attn_layers
    s.teacher_eval = a.teacher_eval or s.teacher_eval
    s.loss_backend = a.loss_backend
    # the teacher's figures, computed once per teacher, harness and settings (committed: a later
    # run on a fresh machine copies them instead of evaluating the teacher again)
    s.teacher_reference = str(a.results / "reference_figures")
    if a.seed is not None:
        s.seed = a.seed
    if a.select_csr_offset is not None:
        s.select_csr_offset = a.select_csr_offset
    if a.stage2_seq_len is not None:
        s.stage2_seq_len = a.stage2_seq_len
    s.calib_objective = a.calib_objective or s.calib_objective
    s.calib_lengths = a.calib_lengths or s.calib_lengths
    if a.stage3_data:
        if not (a.work / "corpus" / a.stage3_data / "manifest.json").exists():
            raise SystemExit(f"error: --stage3-data {a.stage3_data}: no such set in "
                             f"{a.work / 'corpus'} (long_retrieval: build the corpus with "
                             "--retrieval-docs)")
        s.stage3_data = str(a.work / "corpus" / a.stage3_data)
    return s


def cmd_run(a) -> int:
    t0 = time.time()
    if not corpus_done(a.work):
        raise SystemExit(f"error: no corpus in {a.work / 'corpus'}: run `real_conversion.py "
                         "corpus` first")
    s = settings_for(a)
    check_same_pe(run_dir(a), s.pe)
    s.deadline_s, s.pause_after = a.deadline_s, a.pause_after
    check_experiment_flags(a)
    if a.share_stage1_from:
        share_stage1(a, s, a.work / a.share_stage1_from)
    if a.share_stage3_from:
        share_stage3(a, s, a.work / a.share_stage3_from)
    demo = arm_demo(a, s, run_dir(a)) if a.opd_arm else Demo(s)
    code = 0
    try:
        align_teacher_tokenizer(a.work)
        demo.main()
        if a.speed:
            speed(a, demo)
    except DemoPaused as e:
        print(f"[real] paused: {e}. Run the same command again to continue.", flush=True)
        code = PAUSED
    finally:
        record_piece(run_dir(a), t0, code)
    collect(a, partial=code == PAUSED)
    return code


def check_experiment_flags(a) -> None:
    """One run folder per arm, one shared start."""
    if a.opd_arm and not a.tag:
        raise SystemExit(f"error: --opd-arm {a.opd_arm} is an experiment: give it a --tag of its "
                         "own (its results go beside the run it continues)")
    if a.share_stage1_from and a.share_stage3_from:
        raise SystemExit("error: --share-stage1-from and --share-stage3-from: give one (stage 3's "
                         "run folder holds its stage 1 too)")


def speed(a, demo: Demo) -> None:
    """Prefill and decode of teacher vs student at 8K-128K, alone on the GPU (after the
    evaluations)."""
    from halo_dist.teacher import smollm2_teacher_dir

    run = run_dir(a)
    out = run / "speed.json"
    student = run / "hypenet" if a.pe in ("", "hype") else hype_twin(run / "hypenet",
                                                                     run / "hypenet_hype_twin")
    cmd = [sys.executable, str(ROOT / "bench" / "bench_inference.py"), "--real",
           str(smollm2_teacher_dir()), str(student), "--out", str(out)]
    cmd += ["--cpu-smoke"] if a.cpu_rehearsal else ["--contexts", *SPEED_CONTEXTS.split(","),
                                                    "--decode-steps", "8"]
    demo.run("speed", cmd, out)


# ------------------------------------------------------------------------------------------ collect
def cmd_collect(a) -> int:
    collect(a)
    return 0


def collect(a, partial: bool = False) -> Path:
    """``real_conversion.json`` and the PNGs from whatever the run folder holds so far."""
    run = run_dir(a)
    a.results.mkdir(parents=True, exist_ok=True)
    result = summarize(a.work, run)
    result["complete"] = not partial and (run / "eval" / "student" / "DONE").exists()
    stem = result_stem(result["pe"], (result["settings"] or {}).get("seed"),
                       a.tag)
    path = a.results / f"{stem}.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    pictures(run, a.results, stem)
    print(f"[real] wrote {path}", flush=True)
    return path


def main(argv=None) -> int:
    a = parse_args(argv)
    a.work = a.work.resolve()
    a.work.mkdir(parents=True, exist_ok=True)
    if a.cpu_rehearsal and a.results == RESULTS:
        a.results = a.work / "results"  # a rehearsal's figures are not results
    commands = {"corpus": cmd_corpus, "prompts": cmd_prompts, "warmup": cmd_warmup, "run": cmd_run,
                "collect": cmd_collect, "compare": cmd_compare, "compare-runs": cmd_compare_runs}
    return commands[a.command](a)


if __name__ == "__main__":
    sys.exit(main())
