"""The settings of `halo-dist demo`: every field is a flag; presets for CPU, tests and one H200."""

from __future__ import annotations

from dataclasses import dataclass, field


def _flag(default, text: str, empty: str = ""):
    """A setting: its default, its ``--help`` text and, for an empty default, what empty means
    (shown as the default: an empty string says nothing)."""
    return field(default=default, metadata={"help": text, "empty": empty})


@dataclass
class DemoSettings:
    """Sizes and budgets of the demo (every field is a `halo-dist demo` flag)."""

    out: str = _flag("runs/demo", "output folder (a finished step found there is skipped)")
    docs: int = _flag(1000, "Wikipedia extracts tokenized when no --data is given")
    data: str = _flag("", "prebuilt shard folder (manifest + train/heldout splits, from `python -m "
                          "data_prep.tokenize`)", "the Wikipedia extracts tokenized into OUT/data")
    data_long: str = _flag("", "prebuilt long-document shards for stage 3 and calibration",
                           "--data")
    stage3_data: str = _flag("", "prebuilt shards for stage 3 alone, e.g. long documents mixed "
                             "with synthetic retrieval ones (calibration keeps --data-long)",
                             "--data-long")
    config_dir: str = _flag("configs/demo", "folder of the demo's stage1/2/3.yaml")
    seq_len: int = _flag(256, "context of stages 1 and 2 (tokens)")
    long_seq_len: int = _flag(1024, "context of stage 3 and calibration (tokens)")
    # its rows per step shrink so that a step keeps global_batch x seq_len tokens and the stage its
    # token budget
    stage2_seq_len: int = _flag(0, "stage 2's context, its rows per step scaled to keep the tokens "
                                   "(0: --seq-len)")
    stage1_steps: int = _flag(12, "optimizer steps of stage 1")
    stage2_steps: int = _flag(14, "optimizer steps of stage 2")
    stage3_steps: int = _flag(4, "optimizer steps of stage 3")
    global_batch: int = _flag(8, "rows per step in stages 1 and 2")
    micro_batch: int = _flag(4, "rows per forward in stages 1 and 2")
    stage3_global_batch: int = _flag(2, "rows per step in stage 3")
    stage3_micro_batch: int = _flag(1, "rows per forward in stage 3")
    compile: str = _flag("none", "model.compile of stage 2")
    # a short stage: compiling may cost more than it saves
    stage3_compile: str = _flag("none", "model.compile of stage 3")
    loss_backend: str = _flag("", "loss.backend of stages 2 and 3", "the stage configs' (auto)")
    # all_rope keeps the teacher's attention RoPE, trained without logits scaling (the HyPE
    # ablation)
    pe: str = _flag("", "model.pe of stages 1 and 2 (stage 3 keeps stage 2's)", "hype")
    num_attn: int = _flag(7, "attention layers kept (k = floor(30 / 4))")
    # e.g. for an ablation that must keep another run's layers so that only the setting under study
    # differs
    attn_layers: str = _flag("", "attention layers given instead of selected (\"7,18,19\"): the "
                                 "selection step is skipped", "selected by the label-free proxy")
    select_items: int = _flag(6, "retrieval prompts per layer for the selection's recall proxy")
    select_csr_offset: float = _flag(1e-6, "added to each layer's CSR drop in the selection score "
                                           "(1e-6: the paper's; see eval/selection.py)")
    select_length: int = _flag(256, "length of the selection's retrieval prompts (tokens)")
    kl_rows: int = _flag(4, "held-out rows of the selection's KL proxy")
    calib_grid: str = _flag("none,50,200,500,2000", "logits-scaling bases a tried by calibration")
    calib_rows: int = _flag(2, "held-out rows at --long-seq-len scored by calibration")
    # the held-out loss weighs every token alike and few need far context; retrieval scores the
    # answer of a fact recalled across the whole prompt (data_prep.retrieval's phrasings in
    # held-out filler of --data-long)
    calib_objective: str = _flag("loss", "what calibration minimizes: the held-out loss at "
                                         "--long-seq-len, or the answer NLL of retrieval prompts")
    calib_lengths: str = _flag("", "prompt lengths of --calib-objective retrieval (\"32K,64K\")",
                               "--long-seq-len")
    calib_prompts: int = _flag(16, "retrieval prompts per length scored by --calib-objective "
                                   "retrieval")
    # two seeds of one recipe measure how far its figures move from run to run
    seed: int = _flag(1234, "training seed of stages 1-3 (data order and every per-rank RNG)")
    niah_lengths: str = _flag("256,512", "NIAH context lengths")
    niah_tasks: str = _flag("", "NIAH tasks, each optionally @LENGTH, its longest prompt "
                                "(niah_single_2@8K)", "all three at every length")
    niah_depths: str = _flag("3", "NIAH needle depths: a count (evenly spaced 0..1) or a list")
    niah_samples: int = _flag(1, "NIAH prompts per (task, depth) at each length")
    niah_batch: int = _flag(4, "NIAH prompts per batch")
    niah_batch_tokens: int = _flag(0, "> 0: NIAH prompts per batch = tokens // length (at most "
                                      "--niah-batch)")
    niah_static_decode: bool = _flag(False, "the student's NIAH through HypeNet's static "
                                            "(CUDA-graph) cache")
    csr_tasks: str = _flag("hellaswag,arc_easy,arc_challenge", "commonsense tasks (lm-eval)")
    csr_limit: int = _flag(25, "items per CSR task (0: every item)")
    csr_batch: int = _flag(8, "CSR batch size")
    ppl_seq_len: int = _flag(256, "held-out perplexity of teacher and student at this length "
                                  "(0: skip)")
    ppl_rows: int = _flag(8, "held-out rows of the perplexity")
    device: str = _flag("cpu", "where evaluation and selection run (stages use the launcher's "
                               "device)")
    dtype: str = _flag("fp32", "evaluation precision")
    deadline_s: float = _flag(0.0, "stop cleanly after this many seconds, exit code 3; the same "
                                   "command continues (0: no deadline)")
    # a piece can end between stages, so that no stage pays a resume (checkpoint, restart, compile)
    # when the piece lengths are known in advance
    pause_after: str = _flag("", "pause once this step has run", "no pause")
    keep_checkpoints: bool = _flag(False, "keep each stage's resumable checkpoints once its final "
                                          "export is written")
    # with-stages: a 135M teacher leaves the GPU mostly idle, and it needs nothing the stages make;
    # none: an ablation compared with a run that evaluated the same teacher through the same harness
    teacher_eval: str = _flag("at-end", "when the teacher is evaluated: with the student, "
                                        "alongside stages 1-3, or not at all")
    # runs that share a tokenizer and NIAH settings can share it
    niah_prompts: str = _flag("", "folder of the built NIAH prompts", "OUT/eval/niah_prompts")
    # its evaluation is computed once per teacher, harness and settings and then copied
    teacher_reference: str = _flag("", "folder of the teacher's reference figures (\"off\": "
                                       "evaluate the teacher in every run)",
                                   "$HALO_CACHE/reference_figures")
    # off for one GPU: NIAH's greedy decode is a chain of small kernels, and a GPU time-sliced with
    # CSR's large batches made each decode step ~150 ms on an H200 (NIAH 203 s beside a 71-s CSR,
    # against 163 s alone)
    split_student_eval: bool = _flag(False, "the student's NIAH in one process and its CSR + "
                                            "perplexity in another, at the same time")

    @classmethod
    def tiny(cls, out: str) -> "DemoSettings":
        """The smallest setting (tests): every step runs, on a few hundred tokens."""
        return cls(out=out, docs=200, seq_len=64, long_seq_len=128, stage1_steps=3,
                   stage2_steps=3, stage3_steps=3, global_batch=2, micro_batch=2, select_items=2,
                   select_length=96, kl_rows=1, niah_lengths="160", niah_depths="2", csr_limit=4,
                   calib_grid="none,500", ppl_seq_len=64, ppl_rows=2)

    @classmethod
    def h200(cls, out: str) -> "DemoSettings":
        """One H200: 20M / 60M / 10M tokens in stages 1 / 2 / 3 (about half the paper's 1.35 tokens
        per teacher parameter, what 20 minutes allow), full CSR sets. NIAH-S1 from 2K to 64K (8x
        the teacher's trained positions), S2 and S3 to 8K, at 11 depths (0, 0.1, .., 1) x 5
        needles: 50 prompts per cell inside the haystack, 5 at its end reported apart. The
        calibration grid spans the bases the earlier runs chose (500, with 200 within 0.001 of it;
        100 and 5000 were never near the best)."""
        return cls(out=out, config_dir="configs/demo_h200", seq_len=512, long_seq_len=16384,
                   stage1_steps=306, stage2_steps=916, stage3_steps=77, global_batch=128,
                   micro_batch=128, stage3_global_batch=8, stage3_micro_batch=4,
                   compile="layer", select_items=64, select_length=2048, kl_rows=64,
                   calib_grid="none,200,500,1000,2000", calib_rows=8,
                   niah_lengths="2K,4K,8K,16K,32K,64K",
                   niah_tasks="niah_single_1,niah_single_2@8K,niah_single_3@8K",
                   niah_depths="11", niah_samples=5,
                   niah_batch=16, niah_batch_tokens=262144, niah_static_decode=True,
                   csr_tasks="hellaswag,arc_easy,arc_challenge,piqa,winogrande", csr_limit=0,
                   csr_batch=128, ppl_seq_len=2048, ppl_rows=64, device="cuda", dtype="bf16",
                   teacher_eval="with-stages")


TEACHER_EVAL_CHOICES = ("at-end", "with-stages", "none")
CALIB_OBJECTIVES = ("loss", "retrieval")
# steps run alone
PAUSE_POINTS = ("data", "stage1", "select-layers", "stage2", "stage3", "calibrate-a")
PRESETS = {"default": lambda out: DemoSettings(out=out), "tiny": DemoSettings.tiny,
           "h200": DemoSettings.h200}
DTYPE_CHOICES = ("fp32", "bf16")


def choices() -> dict[str, tuple[str, ...]]:
    """The values of the settings that take a fixed set (setting -> values), read from the configs
    that receive them; an empty string is also accepted where the default is empty."""
    from typing import get_args, get_type_hints

    from ..config import PE_ROPE, LossConfig, ModelConfig

    compile_ = get_args(get_type_hints(ModelConfig)["compile"])
    return {"pe": tuple(PE_ROPE), "compile": compile_, "stage3_compile": compile_,
            "loss_backend": get_args(get_type_hints(LossConfig)["backend"]),
            "teacher_eval": TEACHER_EVAL_CHOICES, "pause_after": PAUSE_POINTS,
            "dtype": DTYPE_CHOICES, "calib_objective": CALIB_OBJECTIVES}


def describe_default(f) -> str:
    """``default: 256; presets tiny: 64, h200: 512`` for a setting's field: what each preset sets
    (an empty default by its meaning)."""
    def shown(value) -> str:
        return (f.metadata.get("empty") or "empty") if value == "" else str(value)

    presets = [f"{name}: {shown(v)}" for name, make in PRESETS.items() if name != "default"
               for v in [getattr(make("runs/demo"), f.name)] if v != f.default]
    return f"default: {shown(f.default)}" + (f"; presets {', '.join(presets)}" if presets else "")
