"""The run configuration: nested typed dataclasses, validated on construction.

Each section checks its own fields in ``validate``; :class:`RunConfig` checks combinations across
sections. Everything that can be checked before a process group or a tensor exists is checked
here, so a bad config fails in the launcher's first second instead of after the teacher loaded.
The only checks left for runtime need the world size: :meth:`RunConfig.validate_against_world`.
Defaults follow the HALO paper: AdamW β (0.9, 0.95), no weight decay, clip 1.0, 50 warm-up
steps, bf16.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional

from .coerce import ConfigError, coerce_fields, fail

StageName = Literal["stage1", "stage2", "stage3", "opd", "pretrain"]
Objective = Literal["mse", "kl", "ce", "reverse_kl", "jsd"]
# From-scratch architectures of the sweeps and HypeNet position encodings (sweeps and distilled
# students; paper §6.3).
ScratchArch = Literal["transformer", "swan", "hypenet"]
ScratchPE = Literal["hype", "all_rope", "all_nope", "attn_rope_rnn_nope"]
# model.pe -> HypeNet (attn_rope, rnn_rope). One table for the model stage pretrain builds and for the
# student the distillation stages convert from the teacher; null means hype.
PE_ROPE: dict[str, tuple[bool, bool]] = {"hype": (False, True), "all_rope": (True, True),
                                         "all_nope": (False, False), "attn_rope_rnn_nope": (True, False)}

# Which objectives each stage may train with: stage 1 aligns layer outputs by MSE,
# stage 2 is forward KL (CE-only would skip the teacher), stage 3 KL or the reference code's
# plain CE, OPAL is reverse KL on student samples (or the generalized JSD of ``opd.beta``, TRL's GKD
# objective), from-scratch pretraining is CE.
STAGE_OBJECTIVES: dict[str, tuple[str, ...]] = {
    "stage1": ("mse",),
    "stage2": ("kl",),
    "stage3": ("kl", "ce"),
    "opd": ("reverse_kl", "jsd"),
    "pretrain": ("ce",),
}


@dataclass(kw_only=True, frozen=True)
class Section:
    """Base of every config section: coerce field types, then run ``validate``."""

    def __post_init__(self) -> None:
        coerce_fields(self)
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` (via ``fail``) on an impossible value; keys are relative."""


def _positive(key: str, value: float | int) -> None:
    if value <= 0:
        fail(key, f"must be > 0, got {value}")


def _non_negative(key: str, value: float | int) -> None:
    if value < 0:
        fail(key, f"must be >= 0, got {value}")


@dataclass(kw_only=True, frozen=True)
class RandomTeacherConfig(Section):
    """A randomly initialised teacher (CPU tests, GPU benchmarks of the real shapes).

    Field names are Hugging Face ``Qwen3Config`` / ``LlamaConfig`` names so a builder can pass them
    through. ``architecture`` picks the family: Qwen3 (QK-norm in attention) or Llama (none, as SmolLM2),
    so a benchmark or warm-up runs, and compiles, the same layers as the real teacher.
    """

    architecture: Literal["qwen3", "llama"] = "qwen3"

    num_hidden_layers: int  # transformer blocks
    hidden_size: int  # model width d
    intermediate_size: int  # SwiGLU FFN width
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # KV heads (GQA); must divide num_attention_heads
    head_dim: int  # per-head width d_h
    vocab_size: int
    tie_word_embeddings: bool = True  # Qwen3-1.7B/4B tie, Qwen3-8B does not
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    seed: int = 0  # weight-init seed, so every rank and every test builds the same teacher

    def validate(self) -> None:
        for name in ("num_hidden_layers", "hidden_size", "intermediate_size", "head_dim",
                     "num_attention_heads", "num_key_value_heads", "vocab_size"):
            _positive(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            fail("num_key_value_heads", f"{self.num_key_value_heads} does not divide "
                 f"num_attention_heads={self.num_attention_heads}")


@dataclass(kw_only=True, frozen=True)
class ScratchModelConfig(Section):
    """Shape and initialisation of the randomly initialised model that stage ``pretrain`` trains.

    Field names are ``HypeNetConfig``'s. RNN layers have ``num_attention_heads`` heads of
    ``head_dim`` (HypeNet's RNN heads are the attention's query heads; paper Table 13: 16 and 16).
    Init (halo_dist/stages/pretrain.py): every matrix and the embedding ~ N(0, init_std²), output
    projections (mixer ``o_proj``, MLP ``down_proj``) ~ N(0, init_std² / (2 · num_hidden_layers)),
    norms 1, output-gate weights 0 (gate = 1 at the start).
    """

    vocab_size: int  # GPT-2's 50,257 padded to 50,304 for the sweeps
    num_hidden_layers: int
    hidden_size: int  # model width d
    intermediate_size: int  # SwiGLU FFN width
    num_attention_heads: int  # query heads (attention) = heads (RNN layers)
    num_key_value_heads: int  # KV heads of the attention layers (GQA); must divide the query heads
    head_dim: int  # d_h; even (RoPE)
    tie_word_embeddings: bool = True
    rope_theta: float = 50_000.0  # paper Table 13 (every variant)
    qk_norm: bool = True  # RMSNorm on q/k of attention and Lightning layers (Table 13: yes)
    max_position_embeddings: int = 1_048_576  # only recorded in the exported config
    tokenizer: Optional[str] = None  # HF id/folder: exported with the model and checked against the shards
    init_std: float = 0.02
    init_seed: int = 0  # every rank (and a resumed run's first build) draws the same weights

    def validate(self) -> None:
        for name in ("vocab_size", "num_hidden_layers", "hidden_size", "intermediate_size",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings", "rope_theta", "init_std"):
            _positive(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            fail("num_key_value_heads", f"{self.num_key_value_heads} does not divide "
                 f"num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            fail("head_dim", f"{self.head_dim} must be even (rotary embeddings)")


@dataclass(kw_only=True, frozen=True)
class ModelConfig(Section):
    """Teacher, student initialisation and HypeNet hyperparameters."""

    teacher: Optional[str] = None  # HF hub id or local folder; "random" uses random_teacher; none for pretrain
    random_teacher: Optional[RandomTeacherConfig] = None  # shape of a random teacher
    # run code that a teacher/student folder carries (auto_map, .py); folders halo_dist exported are trusted
    # without it (halo_dist.models.trust)
    trust_remote_code: bool = False
    num_layers: Optional[int] = None  # teacher depth, when known, to range-check attn_layers
    attn_layers: list[int] = field(default_factory=list)  # 0-based layers kept as softmax attention
    student_init: Optional[str] = None  # HypeNet checkpoint/HF folder to start from (stage 3, OPD)
    stage1_weights: Optional[str] = None  # stage-1 output (aligned RNN layers) that stage 2 reads
    rnn_mixer: Literal["lightning", "gdn", "gla", "rwkv7", "mamba2"] = "lightning"
    logits_scaling_a: Optional[float] = None  # a of s_t = log_a(t + a); null disables
    logits_scaling_in_training: bool = True  # also scale in training (the public reference code scales at inference only)
    attn_output_gate: bool = True  # sigmoid gate on attention output, initialised as identity
    attn_output_norm: bool = False  # appendix RMSNorm on attention output; changes the teacher fn
    dtype: Literal["bfloat16", "float32"] = "bfloat16"  # float32 for CPU tests
    activation_checkpointing: bool = True  # applied in model code (DeepSpeed's json block is inert)
    compile: Literal["none", "mlp", "layer"] = "none"  # torch.compile per decoder layer (student + teacher)
    # HypeNet position encoding, null = hype: RoPE in the RNN layers, NoPE in the attention layers (HyPE) |
    # all_rope (attention keeps the teacher's RoPE: the HyPE ablation) | all_nope | attn_rope_rnn_nope.
    # Read by stage pretrain (arch=hypenet) and by the students converted from the teacher (stages 1, 2, OPD;
    # stage 2 refuses stage-1 weights aligned with another RNN RoPE). An all_rope run normally sets
    # logits_scaling_a null (when set, it still scales the attention logits). A student loaded from
    # student_init (stage 3, OPD) keeps its folder's encoding: pe must then be null or the folder's.
    pe: Optional[ScratchPE] = None
    # stage pretrain only (from-scratch sweeps): the variant and the model's shape
    arch: Optional[ScratchArch] = None  # transformer (all attention, RoPE) | swan | hypenet
    sliding_window: Optional[int] = None  # arch=swan: window of the SWA RoPE layers; null = 512
    scratch: Optional[ScratchModelConfig] = None  # shape + init of the randomly initialised model

    def validate(self) -> None:
        if self.teacher is not None and not self.teacher:
            fail("teacher", "must name a hub id, a folder or 'random'")
        if (self.teacher == "random") != (self.random_teacher is not None):
            fail("random_teacher", "set exactly when teacher is 'random'")
        self._validate_attn_layers()
        if self.logits_scaling_a is not None and self.logits_scaling_a <= 1:
            fail("logits_scaling_a", f"must be > 1 (log base), got {self.logits_scaling_a}")
        self._validate_scratch()

    def _validate_scratch(self) -> None:
        if self.pe is not None and self.arch in ("transformer", "swan"):
            fail("pe", f"only arch=hypenet chooses a position encoding (arch={self.arch} has a fixed one); "
                 "remove model.pe")
        if self.sliding_window is not None:
            if self.arch != "swan":
                fail("sliding_window", f"only used by arch=swan, not arch={self.arch}")
            _positive("sliding_window", self.sliding_window)
        if self.arch == "transformer" and self.attn_layers and self.depth is not None \
                and sorted(self.attn_layers) != list(range(self.depth)):
            fail("attn_layers", "arch=transformer has attention in every layer: leave model.attn_layers empty")
        if self.arch is not None and self.scratch is None:
            fail("scratch", f"arch={self.arch} needs the model shape "
                 "(model.scratch: vocab_size, num_hidden_layers, ...)")

    def _validate_attn_layers(self) -> None:
        if len(set(self.attn_layers)) != len(self.attn_layers):
            fail("attn_layers", f"duplicate layer index in {self.attn_layers}")
        depth = self.depth
        for layer in self.attn_layers:
            if layer < 0 or (depth is not None and layer >= depth):
                fail("attn_layers", f"layer {layer} outside 0..{(depth or 0) - 1}")

    @property
    def depth(self) -> Optional[int]:
        """Teacher layer count if the config knows it."""
        if self.random_teacher is not None:
            return self.random_teacher.num_hidden_layers
        if self.scratch is not None:
            return self.scratch.num_hidden_layers
        return self.num_layers


@dataclass(kw_only=True, frozen=True)
class DataConfig(Section):
    """Pre-tokenized webdataset shards and the batch shape (sequences of seq_len tokens)."""

    train: str  # manifest.json, shard folder or brace pattern; paths relative to the working dir
    eval: Optional[str] = None  # shards evaluated by the eval section (default: train's held-out split)
    seq_len: int  # tokens per packed sequence (context length)
    global_batch_size: int  # sequences per optimizer step = micro x grad_accum x dp
    micro_batch_size: int  # sequences per rank per forward; grad_accum derived from dp at runtime
    # When micro x dp does not divide global_batch_size (e.g. 32 sequences over 16 ranks at micro 4), run
    # the largest smaller micro batch that does. The global batch, and so the optimisation, is unchanged.
    fit_micro_batch: bool = False
    num_workers: int = 2  # loader worker processes per rank
    # Shard checks at start-up. full: every shard's structure, counts and sha256, the shards shared out
    # over all ranks (about 1 s per GB and rank, see README); sizes: file sizes only, each shard's
    # checksum then verified when it is first read (a corrupt shard may stop the run hours in).
    verify: Literal["full", "sizes"] = "full"
    shuffle: bool = True  # deterministic shard + sample shuffling
    seed: int = 1234  # shuffle seed (also the base of per-rank RNG seeds)

    def validate(self) -> None:
        if not self.train:
            fail("train", "must name the training shards")
        for name in ("seq_len", "global_batch_size", "micro_batch_size"):
            _positive(name, getattr(self, name))
        _non_negative("num_workers", self.num_workers)
        if self.global_batch_size % self.micro_batch_size:
            fail("global_batch_size", f"{self.global_batch_size} is not a multiple of "
                 f"micro_batch_size={self.micro_batch_size}")


@dataclass(kw_only=True, frozen=True)
class OptimConfig(Section):
    """AdamW (fused on GPU); the peak lr here is the schedule's eta."""

    lr: float  # peak learning rate
    min_lr: float = 1e-5  # floor of cosine/linear/WSD decay (the paper's 1e-5)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0  # the paper uses none for distillation; 0.1 for from-scratch
    grad_clip: Optional[float] = 1.0  # max global grad norm; null disables
    # A NaN/inf loss on any rank: stop (checkpoint the last good state, exit 2) or skip the step
    # (no update, the LR schedule still advances); more than max_skipped_steps skips in a row stop.
    nonfinite: Literal["stop", "skip"] = "stop"
    max_skipped_steps: int = 5  # consecutive skipped steps tolerated by nonfinite=skip

    def validate(self) -> None:
        _positive("lr", self.lr)
        _non_negative("max_skipped_steps", self.max_skipped_steps)
        _non_negative("min_lr", self.min_lr)
        if self.min_lr > self.lr:
            fail("min_lr", f"{self.min_lr} exceeds lr={self.lr}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            fail("betas", f"each beta must be in [0, 1), got {list(self.betas)}")
        _positive("eps", self.eps)
        _non_negative("weight_decay", self.weight_decay)
        if self.grad_clip is not None:
            _positive("grad_clip", self.grad_clip)


@dataclass(kw_only=True, frozen=True)
class ScheduleConfig(Section):
    """LR schedule shape; the run length is total_steps or total_tokens (exactly one)."""

    kind: Literal["cosine", "constant", "wsd", "linear"] = "cosine"
    warmup_steps: int = 50  # linear warm-up from 0 to lr
    decay_steps: Optional[int] = None  # WSD only: length of the final decay to min_lr
    decay_shape: Literal["linear", "cosine", "sqrt"] = "linear"  # WSD decay curve
    total_steps: Optional[int] = None  # optimizer steps ...
    total_tokens: Optional[int] = None  # ... or tokens (steps = ceil(tokens / tokens per step))

    def validate(self) -> None:
        _non_negative("warmup_steps", self.warmup_steps)
        if (self.total_steps is None) == (self.total_tokens is None):
            fail("total_steps", "set exactly one of total_steps and total_tokens")
        for name in ("total_steps", "total_tokens"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.kind == "wsd":
            if self.decay_steps is None:
                fail("decay_steps", "required for kind=wsd")
            _positive("decay_steps", self.decay_steps)
        elif self.decay_steps is not None:
            fail("decay_steps", f"only used by kind=wsd, not kind={self.kind}")

    def resolve_total_steps(self, tokens_per_step: int) -> int:
        """Optimizer steps of the run; tokens round up so the budget is always covered."""
        if self.total_steps is not None:
            return self.total_steps
        return math.ceil(self.total_tokens / tokens_per_step)


@dataclass(kw_only=True, frozen=True)
class ParallelConfig(Section):
    """Data parallel x sequence parallel (Ulysses) on DeepSpeed ZeRO; dp = world / sp at runtime."""

    zero_stage: Literal[0, 1, 2, 3] = 3  # 1/2 only for small students
    sp_size: int = 1  # Ulysses degree; must divide seq_len and the head counts
    teacher_placement: Literal["replicated", "zero3"] = "replicated"  # bf16 copy per GPU or sharded
    deepspeed_config: Optional[str] = None  # JSON merged over the dict built from this config

    def validate(self) -> None:
        _positive("sp_size", self.sp_size)

    def dp_size(self, world_size: int) -> int:
        """Data-parallel degree for ``world_size`` ranks (every sp group holds one replica)."""
        if world_size < 1:
            fail("parallel", f"world size must be >= 1, got {world_size}")
        if world_size % self.sp_size:
            fail("parallel.sp_size", f"{self.sp_size} does not divide the world size {world_size}")
        return world_size // self.sp_size


@dataclass(kw_only=True, frozen=True)
class LossConfig(Section):
    """Distillation objective; KL is fused and chunked, never on full logits."""

    objective: Objective = "kl"  # see STAGE_OBJECTIVES for what each stage allows
    temperature: float = 1.0  # softmax temperature of both models in KL
    ce_weight: float = 0.0  # extra next-token CE term added to a KL objective (0 = off: not computed at all)
    chunk_size: int = 4096  # tokens per chunk of the fused loss (memory vs kernel launches)
    # KL to the teacher only at document positions below this (the teacher's trained context); beyond
    # it next-token CE on the text. A teacher past its positions is a wrong target: a long-context stage
    # would teach the student its failure. null = KL everywhere
    kl_max_position: Optional[int] = None
    # fused-loss implementation: auto (= torch), torch (chunked, eager), compiled (torch with each chunk's
    # forward KL fused by torch.compile: fewer passes over [chunk x vocab]), liger (needs liger-kernel)
    backend: Literal["auto", "torch", "compiled", "liger"] = "auto"

    def validate(self) -> None:
        _positive("temperature", self.temperature)
        _non_negative("ce_weight", self.ce_weight)
        _positive("chunk_size", self.chunk_size)
        if self.backend == "compiled" and self.objective not in ("kl", "ce"):
            fail("backend", f"compiled fuses forward KL only; objective {self.objective} needs torch or liger")
        if self.kl_max_position is not None:
            _positive("kl_max_position", self.kl_max_position)
            if self.objective != "kl":
                fail("kl_max_position", f"splits a forward-KL objective by position; objective is {self.objective}")
        if self.ce_weight > 0 and self.objective not in ("kl", "reverse_kl"):
            fail("ce_weight", f"an extra CE term only applies to KL objectives, "
                 f"not {self.objective}")


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig(Section):
    """Where and how often to save; resume = latest complete checkpoint."""

    dir: Optional[str] = None  # default: <logging.run_dir>/checkpoints
    every_steps: int = 1000  # 0 saves only at the end (and on SIGTERM/SIGUSR1)
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted
    resume: Literal["auto", "never"] = "auto"  # auto: continue from the latest complete one
    save_final: bool = True  # checkpoint after the last step (benchmarks turn it off: 28 GB at 2B)

    def validate(self) -> None:
        _non_negative("every_steps", self.every_steps)
        _positive("keep_last", self.keep_last)


@dataclass(kw_only=True, frozen=True)
class LoggingConfig(Section):
    """Run folder, TensorBoard (+ optional W&B mirror), progress line cadence and the MFU ceiling."""

    run_dir: str = "runs/default"  # TensorBoard events, metrics.jsonl, config.yaml, checkpoints
    # scalars, the resolved config (text tag config/resolved) and the hparams table, under <run_dir>/tb
    tensorboard: bool = True
    # W&B project name: rank 0 mirrors every TensorBoard scalar (same tags and steps) and the hyperparameters
    # to one W&B run per run_dir (its id in <run_dir>/wandb_id, so a resume continues it); needs
    # `pip install wandb` (checked at start-up); null = off
    wandb: Optional[str] = None
    log_every: int = 10  # optimizer steps per metrics reduction (one host sync per interval)
    peak_flops: Optional[float] = None  # per-device FLOP/s for MFU; null: from the device name
    # rank 0 runs torch.profiler over steps [profile_at_step, profile_at_step + profile_steps) and writes
    # <run_dir>/profile/ (summary: wall vs device-busy ms per step, top operators; a Chrome trace); 0 = off
    profile_at_step: int = 0
    profile_steps: int = 3

    def validate(self) -> None:
        if not self.run_dir:
            fail("run_dir", "must not be empty")
        _positive("log_every", self.log_every)
        if self.profile_at_step < 0:
            fail("profile_at_step", f"must be >= 0 (0 = no profile), got {self.profile_at_step}")
        _positive("profile_steps", self.profile_steps)
        if self.wandb is not None and not self.wandb.strip():
            fail("wandb", "must be a W&B project name, or null for no W&B mirror")
        if self.peak_flops is not None:
            _positive("peak_flops", self.peak_flops)


@dataclass(kw_only=True, frozen=True)
class EvalConfig(Section):
    """Held-out evaluation while training (stages 1-3 and pretrain), logged as ``eval/`` curves.

    The same rows are evaluated every time: the first ``rows`` rows of ``data.seq_len`` tokens of the
    ``split`` split of ``data.eval`` (default: the training shards' own held-out split), unshuffled and
    split over the DP ranks like training batches. Stage 1 logs ``eval/mse``; the KL stages log
    ``eval/kl`` (forward KL(teacher || student) per token), ``eval/ce`` and ``eval/teacher_ce``
    (next-token cross-entropy of student and teacher, nats per token).
    """

    every_steps: int = 0  # 0: off; N: before the first step, every N steps and after the last one
    rows: int = 32  # held-out rows per evaluation (rounded down to whole micro-batches per DP rank)
    split: str = "heldout"  # split of the manifest that is evaluated

    def validate(self) -> None:
        _non_negative("every_steps", self.every_steps)
        _positive("rows", self.rows)
        if not self.split:
            fail("split", "must name a manifest split, e.g. heldout")


PromptKind = Literal["wiki", "text_file", "jsonl", "niah", "synthetic"]
# What a fixed-data step (opd.lmbda < 1) trains on after a prompt of each kind, instead of a rollout.
FIXED_CONTINUATION = {"wiki": "the rest of the document the prefix was cut from",
                      "text_file": "the rest of the document the prefix was cut from",
                      "jsonl": "the completion_field text", "niah": "the needle's value",
                      "synthetic": "random tokens drawn with the prompts' seed"}


@dataclass(kw_only=True, frozen=True)
class PromptSetConfig(Section):
    """One prompt set of the on-policy curriculum (``opd.prompt_sets`` entry).

    A set is *active* while ``step >= start_step``, ``horizon >= min_horizon`` and (if set)
    ``step < stop_step``; prompts are drawn from the active sets with probability proportional
    to ``weight``. kinds: ``wiki`` (pre-training text prefixes from the offline Wikipedia
    extracts), ``text_file`` (one document per line / blank-line separated, prefixes of it),
    ``jsonl`` (user prompts, e.g. reasoning problems, text in ``text_field``), ``niah`` (retrieval
    prompts of exactly ``lengths`` tokens from halo_dist.eval.niah), ``synthetic`` (random token
    ids in [4, vocab), for tests and benchmarks).
    """

    name: str
    kind: PromptKind
    path: Optional[str] = None  # text_file / jsonl source
    text_field: str = "prompt"  # jsonl: key holding the prompt text
    completion_field: Optional[str] = None  # jsonl: key of the reference completion (fixed-data steps, opd.lmbda < 1)
    weight: float = 1.0  # relative sampling weight among the active sets
    prompt_tokens: tuple[int, int] = (64, 256)  # wiki/text_file/synthetic: prefix length range
    lengths: list[int] = field(default_factory=list)  # niah: prompt lengths in tokens
    num_prompts: int = 512  # prompts built (wiki, niah, synthetic; files: at most this many)
    heldout: int = 0  # last prompts kept out of training for eval/reverse_kl
    min_horizon: int = 0  # switched in once the rollout horizon reaches this
    start_step: int = 0  # ... and the optimizer step reaches this
    stop_step: Optional[int] = None  # switched out at this step (harder data replaces it)
    max_prompt_tokens: Optional[int] = None  # longer prompts are an error (default opd.max_seq_len - horizon)

    def validate(self) -> None:
        if not self.name:
            fail("name", "must not be empty")
        if self.kind in ("text_file", "jsonl") and not self.path:
            fail("path", f"kind={self.kind} reads prompts from a file: set path")
        if self.completion_field is not None and self.kind != "jsonl":
            fail("completion_field", f"only jsonl sets have one (a {self.kind} set's fixed continuation is "
                 f"{FIXED_CONTINUATION[self.kind]})")
        if self.kind == "niah" and not self.lengths:
            fail("lengths", "kind=niah needs prompt lengths, e.g. [2048, 4096]")
        _positive("weight", self.weight)
        lo, hi = self.prompt_tokens
        if not 1 <= lo <= hi:
            fail("prompt_tokens", f"need 1 <= min <= max, got {list(self.prompt_tokens)}")
        for n in self.lengths:
            _positive("lengths", n)
        _positive("num_prompts", self.num_prompts)
        _non_negative("heldout", self.heldout)
        if self.heldout >= self.num_prompts:
            fail("heldout", f"{self.heldout} leaves no training prompts of num_prompts={self.num_prompts}")
        _non_negative("min_horizon", self.min_horizon)
        _non_negative("start_step", self.start_step)
        if self.stop_step is not None and self.stop_step <= self.start_step:
            fail("stop_step", f"{self.stop_step} is not after start_step={self.start_step}")
        if self.max_prompt_tokens is not None:
            _positive("max_prompt_tokens", self.max_prompt_tokens)


@dataclass(kw_only=True, frozen=True)
class OPDConfig(Section):
    """On-policy distillation (OPAL): rollouts, horizon doubling, curriculum, groups.

    Batch shape comes from ``data``: ``global_batch_size`` rollouts per optimizer step,
    ``micro_batch_size`` rollouts per rank per training forward (``data.train`` is unused).
    """

    horizon_start: int = 512  # new tokens per rollout at the start
    horizon_max: int = 32768  # doubling stops here
    max_seq_len: int = 65536  # prompt + horizon must fit (the context of the training forward)
    plateau_window: int = 20  # steps averaged into one reverse-KL window
    plateau_patience: int = 2  # windows without enough improvement before the horizon doubles
    plateau_min_rel_improvement: float = 0.01  # improvement over the best window, relative
    min_steps_per_horizon: int = 0  # never double sooner than this many steps after a change
    rollout_batch_size: Optional[int] = None  # rollouts generated together per rank (default micro)
    temperature: float = 1.0  # sampling temperature of the student's rollouts
    top_p: float = 1.0  # nucleus sampling of the rollouts (1.0 = full distribution)
    stop_at_eos: bool = True  # a rollout ends at EOS (the EOS token itself is trained)
    static_decode: bool = False  # rollouts through StaticDecoder (CUDA-graph steps; same tokens as dynamic)
    tokenizer: Optional[str] = None  # default: the teacher's; "bytes" = UTF-8 bytes (eval/tokenizers.py; tiny runs)
    eos_token_id: Optional[int] = None  # default: the tokenizer's
    prompt_sets: list[PromptSetConfig] = field(default_factory=list)
    train_attention: bool = True  # OPAL trains the retained attention layers jointly
    rnn_lr: Optional[float] = None  # peak LR of RNN mixers (default optim.lr)
    attn_lr: Optional[float] = None  # peak LR of attention mixers (default optim.lr)
    other_lr: Optional[float] = None  # peak LR of embeddings, MLPs, norms, lm_head (default optim.lr)
    backend: Literal["torch", "deepspeed"] = "torch"  # torch: AdamW + DP all-reduce; deepspeed: ZeRO
    snapshot_every: int = 0  # pre-decay snapshots every N steps (kept forever); 0: only at decay start
    resume_from: Optional[str] = None  # a snapshot folder to continue from (a rung: larger total_steps)
    eval_every: int = 0  # held-out reverse KL every N steps (0: only at start and end)
    eval_horizon: Optional[int] = None  # rollout length of the eval (default horizon_start)
    kl_bucket_min: int = 64  # first position bucket [0, min); then powers of two up to horizon_max
    seed: int = 0  # prompt sampling and rollout RNG seed (offset by rank)
    # TRL GKD's knobs. beta: the generalized JSD's interpolation, 0 forward KL(teacher || student),
    # 1 reverse KL(student || teacher) (values other than 1 need loss.objective jsd). lmbda: the share
    # of optimizer steps trained on student rollouts; the others train on the prompt sets' fixed
    # continuations (FIXED_CONTINUATION). Which steps is a function of (seed, step) alone.
    beta: float = 1.0
    lmbda: float = 1.0

    def validate(self) -> None:
        for name in ("horizon_start", "horizon_max", "max_seq_len", "plateau_window",
                     "plateau_patience", "kl_bucket_min"):
            _positive(name, getattr(self, name))
        if self.horizon_max < self.horizon_start:
            fail("horizon_max", f"{self.horizon_max} is below horizon_start={self.horizon_start}")
        if self.horizon_max >= self.max_seq_len:
            fail("max_seq_len", f"{self.max_seq_len} leaves no room for a prompt at "
                 f"horizon_max={self.horizon_max}")
        _non_negative("plateau_min_rel_improvement", self.plateau_min_rel_improvement)
        _non_negative("min_steps_per_horizon", self.min_steps_per_horizon)
        if self.rollout_batch_size is not None:
            _positive("rollout_batch_size", self.rollout_batch_size)
        _positive("temperature", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not self.prompt_sets:
            fail("prompt_sets", "empty: give at least one prompt set")
        names = [p.name for p in self.prompt_sets]
        if len(set(names)) != len(names):
            fail("prompt_sets", f"duplicate names in {names}")
        if not any(p.start_step == 0 and p.min_horizon <= self.horizon_start for p in self.prompt_sets):
            fail("prompt_sets", "no set is active at step 0 with horizon_start="
                 f"{self.horizon_start} (start_step 0 and min_horizon <= horizon_start)")
        for name in ("rnn_lr", "attn_lr", "other_lr"):
            if getattr(self, name) is not None:
                _non_negative(name, getattr(self, name))
        _non_negative("snapshot_every", self.snapshot_every)
        _non_negative("eval_every", self.eval_every)
        if self.eval_horizon is not None:
            _positive("eval_horizon", self.eval_horizon)
        for name in ("beta", "lmbda"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                fail(name, f"must be in [0, 1], got {getattr(self, name)}")
        if self.lmbda < 1.0:
            missing = [p.name for p in self.prompt_sets if p.kind == "jsonl" and p.completion_field is None]
            if missing:
                fail("prompt_sets", f"lmbda={self.lmbda} trains some steps on the prompt sets' fixed "
                     f"continuations, but the jsonl set(s) {missing} have no completion_field")


@dataclass(kw_only=True, frozen=True)
class StageConfig(Section):
    """Which pipeline stage this run is."""

    name: StageName


@dataclass(frozen=True)
class BatchLayout:
    """Batch arithmetic for one world size: global = micro x grad_accum x dp."""

    world_size: int
    dp_size: int
    sp_size: int
    micro_batch_size: int
    grad_accum_steps: int
    global_batch_size: int
    seq_len: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    def describe(self) -> str:
        """The rank-0 start line: ``layout: world 2 = dp 2 x sp 1; global batch 4 = micro 2 x grad_accum 1 x dp 2``."""
        return (f"layout: world {self.world_size} = dp {self.dp_size} x sp {self.sp_size}; global batch "
                f"{self.global_batch_size} = micro {self.micro_batch_size} x grad_accum {self.grad_accum_steps} "
                f"x dp {self.dp_size}; seq_len {self.seq_len} ({self.tokens_per_step:,} tokens per step)")


@dataclass(kw_only=True, frozen=True)
class RunConfig(Section):
    """A whole run; build it with :func:`halo_dist.config.load_config`."""

    stage: StageConfig
    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    schedule: ScheduleConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    opd: Optional[OPDConfig] = None  # on-policy distillation settings (stage opd only)

    def validate(self) -> None:
        self._validate_opd()
        self._validate_pretrain()
        allowed = STAGE_OBJECTIVES[self.stage.name]
        if self.loss.objective not in allowed:
            fail("loss.objective", f"{self.stage.name} trains with {'|'.join(allowed)}, "
                 f"not {self.loss.objective}")
        if self.data.seq_len % self.parallel.sp_size:
            fail("data.seq_len", f"{self.data.seq_len} is not divisible by "
                 f"parallel.sp_size={self.parallel.sp_size}")
        self._validate_sp_heads()
        self._validate_schedule_fits()
        self._validate_compile()

    def _validate_compile(self) -> None:
        if self.model.compile == "none":
            return
        if self.parallel.zero_stage == 3:
            fail("model.compile", f"{self.model.compile} needs parallel.zero_stage <= 2: ZeRO-3 gathers each "
                 "layer's parameters in hooks that a compiled layer does not run (it would see empty shards)")
        if self.stage.name not in ("stage2", "stage3"):
            fail("model.compile", f"is applied by the distillation stages 2/3, not {self.stage.name}: set none")

    def _validate_opd(self) -> None:
        if (self.stage.name == "opd") != (self.opd is not None):
            fail("opd", "set exactly when stage.name is opd")
        if self.opd is None:
            return
        if self.parallel.sp_size != 1:
            fail("parallel.sp_size", "on-policy distillation runs without sequence parallelism (1)")
        if self.loss.objective == "reverse_kl" and self.opd.beta != 1.0:
            fail("opd.beta", f"{self.opd.beta} with loss.objective=reverse_kl (which is beta 1): set "
                 "loss.objective=jsd to train the generalized JSD")
        if self.schedule.total_tokens is not None:
            fail("schedule.total_tokens", "opd counts optimizer steps (tokens per step change with "
                 "the horizon): set schedule.total_steps")

    def _validate_pretrain(self) -> None:
        """Stage pretrain trains a random model of ``model.arch`` / ``model.scratch``, nothing else."""
        m = self.model
        if self.stage.name != "pretrain":
            if m.teacher is None:
                fail("model.teacher", f"{self.stage.name} distills from a teacher: set a hub id, a folder or 'random'")
            for name in ("arch", "sliding_window", "scratch"):
                if getattr(m, name) is not None:
                    fail(f"model.{name}", f"only used by stage pretrain (from scratch), not {self.stage.name}")
            return
        if m.arch is None:
            fail("model.arch", "stage pretrain needs the architecture: transformer | swan | hypenet")
        for name in ("teacher", "random_teacher", "student_init", "stage1_weights"):
            if getattr(m, name) is not None:
                fail(f"model.{name}", "stage pretrain trains from scratch: no teacher or initial weights "
                     "(a restarted run resumes from its checkpoints)")

    def _validate_sp_heads(self) -> None:
        # Only a random teacher's (or a from-scratch model's) head count is known before loading;
        # real teachers are checked by the parallel layer once their HF config is read.
        shape = self.model.random_teacher or self.model.scratch
        if shape is not None and shape.num_attention_heads % self.parallel.sp_size:
            fail("parallel.sp_size", f"{self.parallel.sp_size} does not divide "
                 f"num_attention_heads={shape.num_attention_heads}")

    def _validate_schedule_fits(self) -> None:
        total, sched = self.total_steps, self.schedule
        if sched.warmup_steps >= total:
            fail("schedule.warmup_steps",
                 f"{sched.warmup_steps} is not below the run's {total} steps")
        if sched.kind == "wsd" and sched.warmup_steps + sched.decay_steps > total:
            fail("schedule.decay_steps", f"warmup {sched.warmup_steps} + decay {sched.decay_steps} "
                 f"exceeds the run's {total} steps")

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step (global batch x context), independent of the world size."""
        return self.data.global_batch_size * self.data.seq_len

    @property
    def total_steps(self) -> int:
        return self.schedule.resolve_total_steps(self.tokens_per_step)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or f"{self.logging.run_dir.rstrip('/')}/checkpoints"

    def fitted_micro_batch(self, world_size: int) -> int:
        """The micro batch this config runs at on ``world_size`` ranks (``data.fit_micro_batch``)."""
        data, dp = self.data, self.parallel.dp_size(world_size)
        if not data.fit_micro_batch or data.global_batch_size % (data.micro_batch_size * dp) == 0:
            return data.micro_batch_size
        fits = [m for m in range(data.micro_batch_size, 0, -1) if data.global_batch_size % (m * dp) == 0]
        return fits[0] if fits else data.micro_batch_size  # none: validate_against_world explains

    def validate_against_world(self, world_size: int) -> BatchLayout:
        """Check the batch and SP layout for ``world_size`` ranks; return the derived layout."""
        dp = self.parallel.dp_size(world_size)
        data = self.data
        per_accum = data.micro_batch_size * dp
        if data.global_batch_size % per_accum:
            no_micro_fits = data.fit_micro_batch and data.global_batch_size % dp != 0
            fail("data.global_batch_size", _batch_hint(data.global_batch_size, data.micro_batch_size, dp,
                                                       no_micro_fits))
        return BatchLayout(world_size=world_size, dp_size=dp, sp_size=self.parallel.sp_size,
                           micro_batch_size=data.micro_batch_size,
                           grad_accum_steps=data.global_batch_size // per_accum,
                           global_batch_size=data.global_batch_size, seq_len=data.seq_len)


def _batch_hint(global_batch: int, micro: int, dp: int, fit: bool = False) -> str:
    """Explain a global batch that micro x dp does not divide, with the nearest fixes."""
    if fit:  # no micro batch fits: the global batch must be a multiple of dp
        below = global_batch // dp * dp
        sizes = " or ".join(str(n) for n in (below, below + dp) if n > 0)
        return (f"{global_batch} is not a multiple of dp ({dp}), so data.fit_micro_batch finds no micro batch "
                f"that fits. Use global_batch_size {sizes}, or another number of ranks")
    per_accum = micro * dp
    below = global_batch // per_accum * per_accum
    sizes = [n for n in (below, below + per_accum) if n > 0]
    micros = [m for m in range(1, global_batch // dp + 1) if global_batch % (m * dp) == 0]
    fixes = "global_batch_size " + " or ".join(str(n) for n in sizes)
    if micros:
        fixes += f", or micro_batch_size in {micros[-4:]}"
    return (f"{global_batch} must equal micro_batch_size ({micro}) x grad_accum x dp ({dp}); "
            f"it is not divisible by {micro}x{dp}={per_accum}. Use {fixes}")


__all__ = [
    "BatchLayout", "CheckpointConfig", "ConfigError", "DataConfig", "EvalConfig", "LoggingConfig", "LossConfig",
    "ModelConfig", "OPDConfig", "OptimConfig", "PE_ROPE", "ParallelConfig", "PromptSetConfig", "RandomTeacherConfig",
    "RunConfig", "ScheduleConfig", "ScratchModelConfig", "Section", "StageConfig", "STAGE_OBJECTIVES",
]
