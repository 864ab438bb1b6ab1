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
from halo_dist.config import PE_ROPE  # noqa: E402
from halo_dist.demo import TEACHER_EVAL_CHOICES, Demo, DemoPaused, DemoSettings  # noqa: E402
from halo_dist.eval.scorecard import read_eval, scorecard  # noqa: E402

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
    w = sub.choices["warmup"]
    w.add_argument("--data", type=Path, required=True,
                   help="token shards made with SmolLM2's tokenizer")
    w.add_argument("--steps", type=int, default=6, help="stage-2 steps")
    c = sub.choices["corpus"]
    c.add_argument("--text", type=Path, required=True,
                   help="carried natural text (bench/build_corpus.py pack --out)")
    c.add_argument("--tokenizer", type=Path, required=True,
                   help="SmolLM2's tokenizer folder (copied to WORK/tokenizer)")
    c.add_argument("--num-proc", type=int, default=os.cpu_count() or 2, help="tokenizer processes")
    c.add_argument("--retrieval-docs", type=int, default=0,
                   help="also build corpus/long_retrieval: long plus this many synthetic retrieval "
                        "documents (build_corpus.py --retrieval-docs; the stage-3 data of an "
                        "experiment, --stage3-data long_retrieval)")
    c.add_argument("--natural-repeats", type=int, default=1,
                   help="weigh the natural text N times (build_corpus.py --natural-repeats). 3 was "
                        "recipe v3: worse than 1 on CSR, perplexity and NIAH, and it "
                        "changed the selected layers")
    c = sub.choices["prompts"]
    c.add_argument("--tokenizer", type=Path, required=True,
                   help="SmolLM2's tokenizer folder (the corpus's)")
    r = sub.choices["run"]
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
    r.add_argument("--loss-backend", choices=("", "auto", "torch", "compiled", "liger"), default="",
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
    r.add_argument("--speed", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the pair's prefill and decode speed after the evaluations (a "
                        "recipe change does not change it: --no-speed saves ~1 GPU-minute)")
    for name in ("run", "collect"):
        sub.choices[name].add_argument(
            "--tag", default="", help="an experiment's name: its results go to "
            "real_conversion_<tag>.json, beside the baseline's (compare them with compare-runs)")
    c = sub.choices["compare-runs"]
    c.add_argument("--base", type=Path, required=True,
                   help="results file of the baseline run (real_conversion*.json)")
    c.add_argument("--arm", type=Path, required=True,
                   help="results file of the run with one change")
    c = sub.choices["compare"]
    c.add_argument("--pe", choices=tuple(k for k in PE_ROPE if k != "hype"), default="all_rope",
                   help="the ablation arm compared with the HyPE run (both results files must "
                        "exist)")
    for c in sub.choices.values():
        c.add_argument("--results", type=Path, default=RESULTS,
                       help="where real_conversion.json and PNGs go")
    return p.parse_args(argv)


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
           "--heldout-fraction", "0.3" if a.cpu_rehearsal else "0.02", "--natural-repeats",
           str(a.natural_repeats), "--retrieval-docs", str(a.retrieval_docs)]
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


def run_dir(a) -> Path:
    """The baseline's run folder (``run``), or an experiment's (``run_<tag>``) beside it."""
    return a.work / (f"run_{a.tag}" if getattr(a, "tag", "") else "run")


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
    demo = Demo(s)
    if a.share_stage1_from:
        share_stage1(a, s, a.work / a.share_stage1_from)
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


# what stage 1 and the per-layer selection results depend on: an experiment that shares them must
# not differ here
STAGE1_SETTINGS = ("seed", "seq_len", "stage1_steps", "global_batch", "micro_batch", "pe", "data",
                   "config_dir", "select_items", "select_length", "kl_rows", "device", "dtype")


def share_stage1(a, s: DemoSettings, base: Path) -> None:
    """Start the experiment ``a.tag`` from the stage 1 (its exported RNN layers) and per-layer
    selection results of the run folder ``base``, hard-linked: the arm then differs from that run
    only in what comes after stage 1, and skips ~4 GPU-minutes. Refused when a setting stage 1
    depends on differs, or ``base``'s stage 1 is not finished."""
    from dataclasses import asdict

    arm = run_dir(a)
    if not a.tag or base.resolve() == arm.resolve():
        raise SystemExit("error: --share-stage1-from is for an experiment: give it a --tag of its "
                         "own")
    base_settings = _read(base / "settings.json")
    if not (base / "stage1" / "final" / "DONE").exists() or base_settings is None:
        raise SystemExit(f"error: --share-stage1-from: {base} holds no finished stage 1")
    mine = asdict(s)
    differ = {k: (base_settings.get(k), mine.get(k)) for k in STAGE1_SETTINGS
              if base_settings.get(k) != mine.get(k)}
    if differ:
        raise SystemExit(f"error: --share-stage1-from: {base.name}'s stage 1 ran with other "
                         f"settings ({base.name}, this run): {differ}")
    for part in ("stage1/final", "select/results.json"):
        src, dst = base / part, arm / part
        if src.exists() and not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, dst, copy_function=os.link)
            else:
                os.link(src, dst)
    print(f"[real] {arm.name} starts from {base.name}'s stage 1 and per-layer selection results",
          flush=True)


def check_same_pe(run: Path, pe: str) -> None:
    """A continued run keeps the position encoding it started with: each piece rewrites
    settings.json, which labels the results, and the steps already done would not be redone with the
    new one."""
    # settings before --pe: hype
    started = (_read(run / "settings.json") or {"pe": pe}).get("pe") or "hype"
    if started != (pe or "hype"):
        raise SystemExit(f"error: {run} was started with --pe {started}, not {pe or 'hype'}: "
                         "continue it with the same --pe, or give another --work")


def record_piece(run: Path, t0: float, code: int) -> None:
    """Append this invocation's wall time to the run's ``pieces.json`` (its GPU minutes add up
    over pieces)."""
    run.mkdir(parents=True, exist_ok=True)
    path = run / "pieces.json"
    pieces = _read(path) or []
    pieces.append({"started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0)),
                   "seconds": round(time.time() - t0, 1), "exit": code})
    path.write_text(json.dumps(pieces, indent=2))


def align_teacher_tokenizer(work: Path) -> None:
    """The corpus was tokenized before the teacher's GGUF was complete on this machine, with
    SmolLM2's tokenizer as saved elsewhere (another transformers version) from the same GGUF. The
    stages refuse shards whose vocabulary hash differs from the teacher's, and the prebuilt NIAH
    prompts are keyed by the tokenizer's whole serialisation; if the folder built here differs in
    either, it takes the corpus's tokenizer files (the same GGUF's tokenizer), and the check runs
    again."""
    from transformers import AutoTokenizer

    from halo_dist.assets.teacher import smollm2_teacher_dir
    from halo_dist.data.errors import DataError
    from halo_dist.data.manifest import check_tokenizer
    from halo_dist.eval.tokenizers import tokenizer_identity

    teacher, corpus = smollm2_teacher_dir(), work / "corpus" / "all"
    try:
        teacher_tok = AutoTokenizer.from_pretrained(teacher)
        check_tokenizer(corpus, teacher_tok)
        if (tokenizer_identity(teacher_tok)
                != tokenizer_identity(AutoTokenizer.from_pretrained(work / "tokenizer"))):
            raise DataError("the same vocabulary, serialised differently (another transformers "
                            "version)")
    except DataError as e:
        print(f"[real] {e}: the teacher folder takes the corpus's tokenizer files from "
              f"{work / 'tokenizer'}", flush=True)
        for f in (work / "tokenizer").iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copyfile(f, teacher / f.name)
        check_tokenizer(corpus, AutoTokenizer.from_pretrained(teacher))
    print(f"[real] teacher {teacher}: its tokenizer is the corpus's (vocabulary hash checked)",
          flush=True)


def speed(a, demo: Demo) -> None:
    """Prefill and decode of teacher vs student at 8K-128K, alone on the GPU (after the
    evaluations)."""
    from halo_dist.assets.teacher import smollm2_teacher_dir

    run = run_dir(a)
    out = run / "speed.json"
    student = run / "hypenet" if a.pe in ("", "hype") else hype_twin(run / "hypenet",
                                                                     run / "hypenet_hype_twin")
    cmd = [sys.executable, str(ROOT / "bench" / "bench_inference.py"), "--real",
           str(smollm2_teacher_dir()), str(student), "--out", str(out)]
    cmd += ["--cpu-smoke"] if a.cpu_rehearsal else ["--contexts", *SPEED_CONTEXTS.split(","),
                                                    "--decode-steps", "8"]
    demo.run("speed", cmd, out)


def hype_twin(student: Path, twin: Path) -> Path:
    """The ablation student's weights in the HyPE layout (attention without RoPE, logits scaling
    on): the speed of the HyPE student, whose kernels and shapes these are (speed does not depend on
    weight values; its outputs do, and this folder is used for nothing else). The base ``a`` only
    scales the logits."""
    if not (twin / "config.json").exists():
        tmp = twin.with_name(twin.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(student, tmp)
        config = json.loads((tmp / "config.json").read_text())
        config.update(attn_rope=False,
                      attn_logits_scale_base=config.get("attn_logits_scale_base") or 500.0)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        os.replace(tmp, twin)
    return twin


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


def result_stem(pe: str, seed: int | None = None, tag: str = "") -> str:
    """``real_conversion`` for the HyPE recipe at the preset's seed, ``real_conversion_<pe>`` for
    an ablation, ``..._<tag>`` for a named experiment and ``..._seed<N>`` for another seed (kept
    side by side)."""
    stem = "real_conversion" if pe in ("", "hype") else f"real_conversion_{pe}"
    stem += f"_{tag}" if tag else ""
    return stem if seed in (None, DemoSettings.seed) else f"{stem}_seed{seed}"


def _read(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


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
    windows = _read(run / "background.json") or []
    stages = {s: stage_summary(run / s, windows) for s in ("stage1", "stage2", "stage3")}
    kl = lambda s, i: (stages[s].get("eval", {}).get("eval/kl")  # noqa: E731
                       or [[None, None]])[i][1]
    evals = {w: read_eval(run / "eval" / w, w) for w in ("teacher", "student")}
    card = scorecard(evals["teacher"], evals["student"])
    settings = _read(run / "settings.json")
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
        "selection": _read(run / "select" / "selection.json"),
        "calibration": _read(run / "calibrate.json"), "speed": _read(run / "speed.json"),
        "timings_s": _read(run / "timings.json"), "background": windows,
        "corpus": _read(work / "corpus" / "corpus_report.json"),
        "warmup": _read(work / "warmup.json"), "settings": settings,
        "pieces": _read(run / "pieces.json"),
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
    pieces = _read(run / "pieces.json")
    if pieces:
        return sum(p["seconds"] for p in pieces) / 60
    timings = _read(run / "timings.json")
    return sum(timings.values()) / 60 if timings else None


# ------------------------------------------------------------------------------------------ compare
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
    hype, arm = _read(hype_path), _read(arm_path)
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
        r = _read(path)
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
    fig = _figure(4.2 * len(NIAH_TASKS), 3.4)
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


# ----------------------------------------------------------------------------------------- pictures
def pictures(run: Path, results: Path, stem: str = "real_conversion") -> list[Path]:
    made = []
    for fn in (_curves_png, _niah_png, _csr_png):
        try:
            path = fn(run, results / f"{stem}_{fn.__name__[1:-4]}.png")
        except (OSError, KeyError, ValueError) as e:  # a part not run yet
            print(f"[real] no {fn.__name__[1:-4]} picture yet ({e})")
            continue
        if path:
            made.append(path)
    return made


def _figure(w, h):
    from halo_dist.figures import new_figure

    return new_figure(w, h)


def _curves_png(run: Path, path: Path) -> Path | None:
    """Per stage: the training loss with its held-out value, and the student's held-out CE beside
    the teacher's (``train.plots``: the demo report's curves, all stages in one picture)."""
    from halo_dist.train.plots import plot_loss_curves

    stages = {s: run / s for s in ("stage1", "stage2", "stage3")
              if (run / s / "metrics.jsonl").exists()}
    return plot_loss_curves(stages, path) if stages else None


def _niah_png(run: Path, path: Path) -> Path | None:
    """Teacher's and student's NIAH heatmaps (share found by depth x length), one row each."""
    from halo_dist.eval.niah_report import heatmap_figure, summarize
    from halo_dist.figures import save

    reports = {w: _read(run / "eval" / w / "niah" / f"{w}.json") for w in ("teacher", "student")}
    if not all(reports.values()):
        return None
    summaries = {w: summarize(r["records"]) for w, r in reports.items()}
    return save(heatmap_figure(summaries, "NIAH: share of needles found by depth and length"),
                path, dpi=100)


def _csr_png(run: Path, path: Path) -> Path | None:
    """Bars per task, teacher vs student, with 95% intervals and the chance level (the demo
    report's picture)."""
    from halo_dist.demo_report import csr_figure, scorecard_of
    from halo_dist.figures import save

    csr = scorecard_of(run)["csr"]
    if not csr or not all(csr["mean"].get(w) is not None for w in ("teacher", "student")):
        return None
    return save(csr_figure(csr), path, dpi=100)


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
