"""A real conversion's run folder across the pieces of a run: where it is, what a continued run or
an experiment sharing another run's stage 1 must match, each piece's wall time, and the files a run
adjusts (the teacher's tokenizer, the HyPE twin of an ablation student)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from halo_dist.pipeline.demo import DemoSettings


def read_json(path: Path):
    """The file's JSON, or None when it does not exist (a part not run yet)."""
    return json.loads(path.read_text()) if path.exists() else None


def run_dir(a) -> Path:
    """The baseline's run folder (``run``), or an experiment's (``run_<tag>``) beside it."""
    return a.work / (f"run_{a.tag}" if getattr(a, "tag", "") else "run")


# what stage 1 and the per-layer selection results depend on: an experiment that shares them must
# not differ here
STAGE1_SETTINGS = ("seed", "seq_len", "stage1_steps", "global_batch", "micro_batch", "pe", "data",
                   "config_dir", "select_items", "select_length", "kl_rows", "device", "dtype")
# what only the steps after stage 3 read (calibration, evaluation) or what schedules the pieces: an
# experiment that shares another run's stages 1-3 may differ here, and in nothing else of the demo
AFTER_STAGE3 = ("out", "calib_grid", "calib_rows", "calib_objective", "calib_lengths",
                "calib_prompts", "niah_lengths", "niah_tasks", "niah_depths", "niah_samples",
                "niah_batch", "niah_batch_tokens", "niah_static_decode", "csr_tasks", "csr_limit",
                "csr_batch", "ppl_seq_len", "ppl_rows", "deadline_s", "pause_after",
                "keep_checkpoints", "teacher_eval", "niah_prompts", "teacher_reference",
                "split_student_eval")


def share_stage1(a, s: DemoSettings, base: Path) -> None:
    """Start the experiment ``a.tag`` from the stage 1 (its exported RNN layers) and per-layer
    selection results of the run folder ``base``, hard-linked: the arm then differs from that run
    only in what comes after stage 1, and skips ~4 GPU-minutes. Refused when a setting stage 1
    depends on differs, or ``base``'s stage 1 is not finished."""
    _share(a, s, base, "--share-stage1-from", "stage1", STAGE1_SETTINGS,
           ("stage1/final", "select/results.json"))


def share_stage3(a, s: DemoSettings, base: Path) -> None:
    """Start the experiment ``a.tag`` from the finished stage 3 of the run folder ``base``: its
    stage-1 layers, selection and stage-2 and stage-3 exports, hard-linked, so that the arm differs
    from that run only after stage 3 (calibration, or the OPD step of arm d) and skips ~11
    GPU-minutes. Refused when any setting of the demo's differs but those only calibration and
    evaluation read (``AFTER_STAGE3``), or ``base``'s stage 3 is not finished. The stages' curves
    stay in ``base``: the arm's results count its own steps and tokens only."""
    from dataclasses import fields

    settings = tuple(f.name for f in fields(DemoSettings) if f.name not in AFTER_STAGE3)
    _share(a, s, base, "--share-stage3-from", "stage3", settings,
           ("stage1/final", "select/results.json", "select/selection.json", "stage2/final",
            "stage3/final"))


def _share(a, s: DemoSettings, base: Path, flag: str, stage: str, settings: tuple[str, ...],
           parts: tuple[str, ...]) -> None:
    """Hard-link ``parts`` of ``base`` into the experiment's run folder once ``base`` finished
    ``stage`` with the same ``settings``."""
    from dataclasses import asdict

    arm = run_dir(a)
    if not a.tag or base.resolve() == arm.resolve():
        raise SystemExit(f"error: {flag} is for an experiment: give it a --tag of its own")
    base_settings = read_json(base / "settings.json")
    what = f"stage {stage[-1]}"
    if not (base / stage / "final" / "DONE").exists() or base_settings is None:
        raise SystemExit(f"error: {flag}: {base} holds no finished {what}")
    mine = asdict(s)
    differ = {k: (base_settings.get(k), mine.get(k)) for k in settings
              if base_settings.get(k) != mine.get(k)}
    if differ:
        raise SystemExit(f"error: {flag}: {base.name}'s {what} ran with other settings "
                         f"({base.name}, this run): {differ}")
    for part in parts:
        src, dst = base / part, arm / part
        if src.exists() and not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, dst, copy_function=os.link)
            else:
                os.link(src, dst)
    print(f"[real] {arm.name} starts from {base.name}'s {what} ({', '.join(parts)})", flush=True)


def check_same_pe(run: Path, pe: str) -> None:
    """A continued run keeps the position encoding it started with: each piece rewrites
    settings.json, which labels the results, and the steps already done would not be redone with the
    new one."""
    # settings before --pe: hype
    started = (read_json(run / "settings.json") or {"pe": pe}).get("pe") or "hype"
    if started != (pe or "hype"):
        raise SystemExit(f"error: {run} was started with --pe {started}, not {pe or 'hype'}: "
                         "continue it with the same --pe, or give another --work")


def record_piece(run: Path, t0: float, code: int) -> None:
    """Append this invocation's wall time to the run's ``pieces.json`` (its GPU minutes add up
    over pieces)."""
    run.mkdir(parents=True, exist_ok=True)
    path = run / "pieces.json"
    pieces = read_json(path) or []
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

    from halo_dist.teacher import smollm2_teacher_dir
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

