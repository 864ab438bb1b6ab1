"""The settings of `halo-dist demo`: every field is a flag; presets for CPU, tests and one H200."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DemoSettings:
    """Sizes and budgets of the demo (every field is a `halo-dist demo` flag)."""

    out: str = "runs/demo"
    docs: int = 1000  # Wikipedia extracts tokenized (when no --data is given)
    # prebuilt shard folder (manifest + train/heldout) instead of the Wikipedia extracts
    data: str = ""
    data_long: str = ""  # prebuilt long-document shards for stage 3 and calibration (default: data)
    # prebuilt shards for stage 3 alone (default: data_long), e.g. long documents mixed with
    # synthetic retrieval ones; calibration keeps data_long
    stage3_data: str = ""
    config_dir: str = "configs/demo"  # stage1/2/3.yaml of the demo
    seq_len: int = 256  # stage 1/2 context
    long_seq_len: int = 1024  # stage 3 context (and calibration length)
    # stage 2's context (0: seq_len); its rows per step shrink so that a step keeps
    # global_batch x seq_len tokens and the stage its token budget
    stage2_seq_len: int = 0
    stage1_steps: int = 12
    stage2_steps: int = 14
    stage3_steps: int = 4
    global_batch: int = 8  # stages 1/2
    micro_batch: int = 4
    stage3_global_batch: int = 2
    stage3_micro_batch: int = 1
    compile: str = "none"  # model.compile of stage 2: none | mlp | layer
    # model.compile of stage 3 (a short stage: compiling may cost more than it saves)
    stage3_compile: str = "none"
    # loss.backend of stages 2-3 (auto | torch | compiled | liger); empty: the configs'
    loss_backend: str = ""
    # model.pe of stages 1 and 2 (stage 3 keeps the stage-2 folder's); empty: hype. all_rope keeps
    # the teacher's attention RoPE, trained without logits scaling (the HyPE ablation): hype |
    # all_rope | all_nope | attn_rope_rnn_nope
    pe: str = ""
    num_attn: int = 7  # k = floor(30 / 4)
    # attention layers given instead of selected ("7,18,19"): the selection step is skipped, e.g.
    # for an ablation that must keep another run's layers so that only the setting under study
    # differs
    attn_layers: str = ""
    select_items: int = 6  # retrieval prompts per layer for the recall proxy
    # added to each layer's CSR drop in the selection score (1e-6: the paper's; see
    # eval/selection.py)
    select_csr_offset: float = 1e-6
    select_length: int = 256
    kl_rows: int = 4
    calib_grid: str = "none,50,200,500,2000"
    calib_rows: int = 2
    # training seed of stages 1-3 (data.seed: the data order and every per-rank RNG); two seeds of
    # one recipe measure how far its figures move from run to run
    seed: int = 1234
    niah_lengths: str = "256,512"
    # each task optionally @LENGTH, its longest prompt (niah_single_2@8K); empty: all three, every
    # length
    niah_tasks: str = ""
    niah_depths: str = "3"
    niah_samples: int = 1  # prompts per (task, depth) at each length
    niah_batch: int = 4
    niah_batch_tokens: int = 0  # > 0: prompts per batch = tokens // length (at most niah_batch)
    # the student's NIAH through HypeNet's static (CUDA-graph) cache
    niah_static_decode: bool = False
    csr_tasks: str = "hellaswag,arc_easy,arc_challenge"
    csr_limit: int = 25  # items per task (0: every item)
    csr_batch: int = 8
    ppl_seq_len: int = 256  # held-out perplexity of teacher and student at this length (0: skip)
    ppl_rows: int = 8
    device: str = "cpu"  # where evaluation and selection run (stages use the launcher's device)
    dtype: str = "fp32"  # evaluation precision: fp32 | bf16
    # stop cleanly after this many seconds (0: none); the same command continues
    deadline_s: float = 0.0
    # pause once this step has run (e.g. "select-layers"): a piece can end between stages, so that
    # no stage pays a resume (checkpoint, restart, compile) when the piece lengths are known in
    # advance
    pause_after: str = ""
    # keep each stage's resumable checkpoints once its final export is written
    keep_checkpoints: bool = False
    # when the teacher's evaluation runs: "at-end" (with the student's), "with-stages" (alongside
    # stages 1-3 on the same GPU: it needs nothing they make, and a 135M model leaves the GPU mostly
    # idle) or "none" (an ablation compared with a run that evaluated the same teacher through the
    # same harness)
    teacher_eval: str = "at-end"
    # folder of the built NIAH prompts (empty: <out>/eval/niah_prompts); runs that share a tokenizer
    # and NIAH settings can share it
    niah_prompts: str = ""
    # folder of the teacher's reference figures: its evaluation is computed once per teacher,
    # harness and settings and then copied (empty: $HALO_CACHE/reference_figures; "off": evaluate
    # the teacher in every run)
    teacher_reference: str = ""
    # the student's NIAH in one process and its CSR + perplexity in another, at the same time. Off
    # for one GPU: NIAH's greedy decode is a chain of small kernels, and a GPU time-sliced with
    # CSR's large batches made each decode step ~150 ms on an H200 (NIAH 203 s beside a 71-s CSR,
    # against 163 s alone)
    split_student_eval: bool = False

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
# steps run alone
PAUSE_POINTS = ("data", "stage1", "select-layers", "stage2", "stage3", "calibrate-a")
PRESETS = {"default": lambda out: DemoSettings(out=out), "tiny": DemoSettings.tiny,
           "h200": DemoSettings.h200}
