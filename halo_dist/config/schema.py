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
from typing import ClassVar, Literal, Optional

from .coerce import ConfigError, fail
from .model_schema import ModelConfig, RandomTeacherConfig
from .opd_schema import OPDConfig, PromptSetConfig
from .pretrain_schema import MOVED_KEYS, PretrainConfig, PretrainModelConfig
from .section import (MAX_STEPS, MAX_TOKENS, Section, _at_most, _learning_rate, _non_negative,
                      _positive)

StageName = Literal["stage1", "stage2", "stage3", "opd", "pretrain"]
Objective = Literal["mse", "kl", "ce", "reverse_kl", "jsd"]
# model.pe -> HypeNet (attn_rope, rnn_rope). One table for the model stage pretrain builds and for
# the student the distillation stages convert from the teacher; null means hype.
PE_ROPE: dict[str, tuple[bool, bool]] = {"hype": (False, True), "all_rope": (True, True),
                                         "all_nope": (False, False),
                                         "attn_rope_rnn_nope": (True, False)}

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
class DataConfig(Section):
    """Pre-tokenized webdataset shards and the batch shape (sequences of seq_len tokens)."""

    train: str  # manifest.json, shard folder or brace pattern; paths relative to the working dir
    # shards evaluated by the eval section (default: train's held-out split)
    eval: Optional[str] = None
    seq_len: int  # tokens per packed sequence (context length)
    global_batch_size: int  # sequences per optimizer step = micro x grad_accum x dp
    micro_batch_size: int  # sequences per rank per forward; grad_accum derived from dp at runtime
    # When micro x dp does not divide global_batch_size (e.g. 32 sequences over 16 ranks at micro
    # 4), run the largest smaller micro batch that does. The global batch, and so the optimisation,
    # is unchanged.
    fit_micro_batch: bool = False
    num_workers: int = 2  # loader worker processes per rank
    # Shard checks at start-up. full: every shard's structure, counts and sha256, the shards shared
    # out over all ranks (about 1 s per GB and rank: docs/design.md); sizes: file sizes only, each
    # shard's checksum then verified when it is first read (a corrupt shard may stop the run hours
    # in).
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
        _learning_rate("lr", self.lr)
        _non_negative("max_skipped_steps", self.max_skipped_steps)
        _learning_rate("min_lr", self.min_lr)
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
        for name, limit in (("total_steps", MAX_STEPS), ("total_tokens", MAX_TOKENS)):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
                _at_most(name, getattr(self, name), limit, name.split("_")[1])
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
    # extra next-token CE term added to a KL objective (0 = off: not computed at all)
    ce_weight: float = 0.0
    chunk_size: int = 4096  # tokens per chunk of the fused loss (memory vs kernel launches)
    # KL to the teacher only at document positions below this (the teacher's trained context);
    # beyond it next-token CE on the text. A teacher past its positions is a wrong target: a
    # long-context stage would teach the student its failure. null = KL everywhere
    kl_max_position: Optional[int] = None
    # fused-loss implementation: auto (on CUDA triton for the forward and reverse KL, compiled
    # for the JSD; torch elsewhere), torch (chunked, eager), compiled (each chunk's divergence and
    # CE fused by torch.compile: fewer passes over [chunk x vocab]), triton (our kernel: two
    # passes over a chunk's logits; forward/reverse KL and CE)
    backend: Literal["auto", "torch", "compiled", "triton"] = "auto"

    def validate(self) -> None:
        _positive("temperature", self.temperature)
        _non_negative("ce_weight", self.ce_weight)
        _positive("chunk_size", self.chunk_size)
        if self.kl_max_position is not None:
            _positive("kl_max_position", self.kl_max_position)
            if self.objective != "kl":
                fail("kl_max_position",
                     f"splits a forward-KL objective by position; objective is {self.objective}")
        if self.ce_weight > 0 and self.objective not in ("kl", "reverse_kl"):
            fail("ce_weight", f"an extra CE term only applies to KL objectives, "
                 f"not {self.objective}")


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig(Section):
    """Where and how often to save; resume = the newest checkpoint that verifies."""

    dir: Optional[str] = None  # default: <logging.run_dir>/checkpoints
    every_steps: int = 1000  # 0 saves only at the end (and on SIGTERM/SIGUSR1)
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted
    # auto: continue from the newest checkpoint that verifies; never: a new run, refused where
    # checkpoints exist (train/checkpoint.py)
    resume: Literal["auto", "never"] = "auto"
    save_final: bool = True  # checkpoint after the last step (benchmarks turn it off: 28 GB at 2B)

    def validate(self) -> None:
        _non_negative("every_steps", self.every_steps)
        _positive("keep_last", self.keep_last)


@dataclass(kw_only=True, frozen=True)
class LoggingConfig(Section):
    """Run folder, TensorBoard (+ optional W&B mirror), progress line cadence and the MFU
    ceiling."""

    run_dir: str = "runs/default"  # TensorBoard events, metrics.jsonl, config.yaml, checkpoints
    # scalars, the resolved config (text tag config/resolved) and the hparams table, under
    # <run_dir>/tb
    tensorboard: bool = True
    # W&B project name: rank 0 mirrors every TensorBoard scalar (same tags and steps) and the
    # hyperparameters to one W&B run per run_dir (its id in <run_dir>/wandb_id, so a resume
    # continues it); needs `pip install wandb` (checked at start-up); null = off
    wandb: Optional[str] = None
    log_every: int = 10  # optimizer steps per metrics reduction (one host sync per interval)
    peak_flops: Optional[float] = None  # per-device FLOP/s for MFU; null: from the device name
    # rank 0 runs torch.profiler over steps [profile_at_step, profile_at_step + profile_steps) and
    # writes <run_dir>/profile/ (summary: wall vs device-busy ms per step, top operators; a Chrome
    # trace); 0 = off
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

    The same rows are evaluated every time: the first ``rows`` rows of ``data.seq_len`` tokens of
    the ``split`` split of ``data.eval`` (default: the training shards' own held-out split),
    unshuffled and split over the DP ranks like training batches. Stage 1 logs ``eval/mse``; the KL
    stages log ``eval/kl`` (forward KL(teacher || student) per token), ``eval/ce`` and
    ``eval/teacher_ce`` (next-token cross-entropy of student and teacher, nats per token).
    """

    every_steps: int = 0  # 0: off; N: before the first step, every N steps and after the last one
    rows: int = 32  # held-out rows per evaluation (rounded down to whole micro-batches per DP rank)
    split: str = "heldout"  # split of the manifest that is evaluated

    def validate(self) -> None:
        _non_negative("every_steps", self.every_steps)
        _positive("rows", self.rows)
        if not self.split:
            fail("split", "must name a manifest split, e.g. heldout")


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
        """The rank-0 start line: ``layout: world 2 = dp 2 x sp 1; global batch 4 = micro 2 x
        grad_accum 1 x dp 2``."""
        return (f"layout: world {self.world_size} = dp {self.dp_size} x sp {self.sp_size}; "
                f"global batch {self.global_batch_size} = micro {self.micro_batch_size} x "
                f"grad_accum {self.grad_accum_steps} x dp {self.dp_size}; seq_len {self.seq_len} "
                f"({self.tokens_per_step:,} tokens per step)")


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
    # the from-scratch variant and its shape (stage pretrain only)
    pretrain: Optional[PretrainConfig] = None
    # keys that belong to another section, to where: an unknown-key error says where
    # (coerce.with_suggestions)
    MOVED_KEYS: ClassVar[dict[str, str]] = MOVED_KEYS
    REMOVED_KEYS: ClassVar[dict[str, str]] = {
        "opd.backend": "OPD always trains under DeepSpeed (parallel.zero_stage 0: plain data "
                       "parallelism, 1-3: ZeRO)",
        "opd.rollout_streams": "one decoder steps every rollout slot (two groups on two CUDA "
                               "streams were measured 9% slower)"}
    # removed keys whose one value today's code still runs as: a checkpoint saved with another
    # value belongs to a run that cannot be continued exactly (train/resume_check.py)
    REMOVED_KEYS_RUN_AS: ClassVar[dict[str, object]] = {"opd.rollout_streams": 1}

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
            fail("model.compile", f"{self.model.compile} needs parallel.zero_stage <= 2: ZeRO-3 "
                                  "gathers each layer's parameters in hooks that a compiled layer "
                                  "does not run (it would see empty shards)")
        if self.stage.name not in ("stage2", "stage3", "pretrain", "opd"):
            fail("model.compile",
                 f"is applied by stages 2/3, OPD and pretrain, not {self.stage.name}: set none")

    def _validate_opd(self) -> None:
        if (self.stage.name == "opd") != (self.opd is not None):
            fail("opd", "set exactly when stage.name is opd")
        if self.opd is None:
            return
        if self.parallel.sp_size != 1:
            fail("parallel.sp_size", "on-policy distillation runs without sequence parallelism (1)")
        if self.loss.objective == "reverse_kl" and self.opd.beta != 1.0:
            fail("opd.beta", f"{self.opd.beta} with loss.objective=reverse_kl (which is beta 1): "
                             "set loss.objective=jsd to train the generalized JSD")
        if self.schedule.total_tokens is not None:
            fail("schedule.total_tokens", "opd counts optimizer steps (tokens per step change with "
                 "the horizon): set schedule.total_steps")

    def _validate_pretrain(self) -> None:
        """Stage pretrain trains a random model of the ``pretrain`` section, nothing else."""
        m, stage = self.model, self.stage.name
        if stage != "pretrain":
            if self.pretrain is not None:
                fail("pretrain",
                     f"only used by stage pretrain (from scratch), not {stage}: remove the section")
            if m.teacher is None:
                fail("model.teacher",
                     f"{stage} distills from a teacher: set a hub id, a folder or 'random'")
            return
        if self.pretrain is None:
            fail("pretrain",
                 "stage pretrain needs this section: pretrain.arch (transformer | swan | hypenet) "
                 "and pretrain.model (the shape: vocab_size, num_hidden_layers, ...)")
        for name in ("teacher", "random_teacher", "student_init", "stage1_weights"):
            if getattr(m, name) is not None:
                fail(f"model.{name}", "stage pretrain trains from scratch: no teacher or initial "
                                      "weights (a restarted run resumes from its checkpoints)")
        self._validate_pretrain_variant()

    def _validate_pretrain_variant(self) -> None:
        """The ``model:`` switches that stage pretrain reads, against ``pretrain.arch`` and its
        depth."""
        m, arch, depth = self.model, self.pretrain.arch, self.pretrain.model.num_hidden_layers
        if m.pe is not None and arch in ("transformer", "swan"):
            fail("model.pe", f"only pretrain.arch=hypenet chooses a position encoding (arch={arch} "
                             "has a fixed one); remove model.pe")
        for layer in m.attn_layers:
            if layer >= depth:
                fail("model.attn_layers", f"layer {layer} outside 0..{depth - 1} "
                     f"(pretrain.model.num_hidden_layers={depth})")
        if arch == "transformer" and m.attn_layers and sorted(m.attn_layers) != list(range(depth)):
            fail("model.attn_layers", "pretrain.arch=transformer has attention in every layer: "
                                      "leave model.attn_layers empty")

    def _validate_sp_heads(self) -> None:
        # Only a random teacher's (or a from-scratch model's) head count is known before loading;
        # real teachers are checked by the parallel layer once their HF config is read.
        shape = self.model.random_teacher or (self.pretrain.model if self.pretrain is not None
                                              else None)
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
        """The micro batch this config runs at on ``world_size`` ranks
        (``data.fit_micro_batch``)."""
        data, dp = self.data, self.parallel.dp_size(world_size)
        if not data.fit_micro_batch or data.global_batch_size % (data.micro_batch_size * dp) == 0:
            return data.micro_batch_size
        fits = [m for m in range(data.micro_batch_size, 0, -1)
                if data.global_batch_size % (m * dp) == 0]
        return fits[0] if fits else data.micro_batch_size  # none: validate_against_world explains

    def validate_against_world(self, world_size: int) -> BatchLayout:
        """Check the batch and SP layout for ``world_size`` ranks; return the derived layout."""
        dp = self.parallel.dp_size(world_size)
        data = self.data
        per_accum = data.micro_batch_size * dp
        if data.global_batch_size % per_accum:
            no_micro_fits = data.fit_micro_batch and data.global_batch_size % dp != 0
            fail("data.global_batch_size",
                 _batch_hint(data.global_batch_size, data.micro_batch_size, dp,
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
        return (f"{global_batch} is not a multiple of dp ({dp}), so data.fit_micro_batch finds no "
                f"micro batch that fits. Use global_batch_size {sizes}, or another number of ranks")
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
    "BatchLayout", "CheckpointConfig", "ConfigError", "DataConfig", "EvalConfig", "LoggingConfig",
    "LossConfig", "ModelConfig", "OPDConfig", "OptimConfig", "PE_ROPE", "ParallelConfig",
    "PretrainConfig", "PretrainModelConfig", "PromptSetConfig", "RandomTeacherConfig", "RunConfig",
    "ScheduleConfig", "Section", "StageConfig", "STAGE_OBJECTIVES",
]
