"""The ``opd:`` section of on-policy distillation: rollouts, the horizon curriculum and the prompt
sets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from .coerce import fail
from .section import Section, _learning_rate, _non_negative, _positive

PromptKind = Literal["wiki", "text_file", "jsonl", "niah", "synthetic"]
# What a fixed-data step (opd.lmbda < 1) trains on after a prompt of each kind, instead of a
# rollout.
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
    # jsonl: key of the reference completion (fixed-data steps, opd.lmbda < 1)
    completion_field: Optional[str] = None
    weight: float = 1.0  # relative sampling weight among the active sets
    prompt_tokens: tuple[int, int] = (64, 256)  # wiki/text_file/synthetic: prefix length range
    lengths: list[int] = field(default_factory=list)  # niah: prompt lengths in tokens
    num_prompts: int = 512  # prompts built (wiki, niah, synthetic; files: at most this many)
    heldout: int = 0  # last prompts kept out of training for eval/reverse_kl
    min_horizon: int = 0  # switched in once the rollout horizon reaches this
    start_step: int = 0  # ... and the optimizer step reaches this
    stop_step: Optional[int] = None  # switched out at this step (harder data replaces it)
    # longer prompts are an error (default opd.max_seq_len - horizon)
    max_prompt_tokens: Optional[int] = None

    def validate(self) -> None:
        if not self.name:
            fail("name", "must not be empty")
        if self.kind in ("text_file", "jsonl") and not self.path:
            fail("path", f"kind={self.kind} reads prompts from a file: set path")
        if self.completion_field is not None and self.kind != "jsonl":
            fail("completion_field", f"only jsonl sets have one (a {self.kind} set's fixed "
                                     f"continuation is {FIXED_CONTINUATION[self.kind]})")
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
            fail("heldout",
                 f"{self.heldout} leaves no training prompts of num_prompts={self.num_prompts}")
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
    # rollouts through StaticDecoder (CUDA-graph steps; same tokens as dynamic)
    static_decode: bool = True
    # the static step through torch.compile, on CUDA (fuses its ~1,000 small kernels: 2B model,
    # 256 rollouts at horizon 2048, 27.6K vs 22.3K rollout tokens/s on an H200); compiles once per
    # rollout count and cache room (the room rounded up to 256 tokens), ~1 min each
    compile_rollouts: bool = True
    # rollouts in rollout_batch_size slots, each restarted on the next prompt when its rollout ends
    # (opd/rollouts.py) instead of batches that wait for their longest rollout; always
    # through StaticDecoder (whatever static_decode says). 28.6K vs 27.1K rollout tokens/s for
    # batches through generate (2B, 256 rollouts at horizon 2048, no EOS, H200): more with EOS on
    continuous_batching: bool = True
    # the rollout decoder's RNN state dtype (Lightning-only students), rounded once per token.
    # bfloat16 halves Lightning's state bytes (~half of a 256-rollout step's) but rollouts drift
    # off-policy: on a converted SmolLM2 the argmax agreed with fp32's at 16% of positions 257-1024
    # (bench/rollout_state_drift.py; measure your student before using it)
    rollout_state_dtype: Literal["float32", "bfloat16"] = "float32"
    # the rollout decoder writes its Lightning states back every n tokens and holds the tokens
    # between as k/v beside them (Lightning-only students; models/hypenet/lightning_state.py): the
    # state moves 1 + 1/n times per token instead of 2, with the same outputs up to fp32
    # rounding. 4 (configs/opd/hypenet_2b.yaml): +14.8% rollout tokens/s over 1 (H100, 384
    # rollouts at h2048). 8 ran at 0.81x of 4 there (with the fold as a loop on 4 warps; at the
    # shipped 2 warps the fused step spills its tile past 4 held tokens). Default 1: every
    # student's RNN layers, not only Lightning's, can decode with it
    rollout_state_write_every: int = 1
    # default: the teacher's; "bytes" = UTF-8 bytes (eval/tokenizers.py; tiny runs)
    tokenizer: Optional[str] = None
    eos_token_id: Optional[int] = None  # default: the tokenizer's
    prompt_sets: list[PromptSetConfig] = field(default_factory=list)
    train_attention: bool = True  # OPAL trains the retained attention layers jointly
    rnn_lr: Optional[float] = None  # peak LR of RNN mixers (default optim.lr)
    attn_lr: Optional[float] = None  # peak LR of attention mixers (default optim.lr)
    # peak LR of embeddings, MLPs, norms, lm_head (default optim.lr)
    other_lr: Optional[float] = None
    # pre-decay snapshots every N steps (kept forever); 0: only at decay start
    snapshot_every: int = 0
    # a snapshot folder to continue from (a rung: larger total_steps)
    resume_from: Optional[str] = None
    eval_every: int = 0  # held-out reverse KL every N steps (0: only at start and end)
    eval_horizon: Optional[int] = None  # rollout length of the eval (default horizon_start)
    kl_bucket_min: int = 64  # first position bucket [0, min); then powers of two up to horizon_max
    seed: int = 0  # prompt sampling and rollout RNG seed (offset by rank)
    # TRL GKD's knobs. beta: the generalized JSD's interpolation, 0 forward KL(teacher || student),
    # 1 reverse KL(student || teacher) (values other than 1 need loss.objective jsd). lmbda: the
    # share of optimizer steps trained on student rollouts; the others train on the prompt sets'
    # fixed continuations (FIXED_CONTINUATION). Which steps is a function of (seed, step) alone.
    beta: float = 1.0
    lmbda: float = 1.0
    # fixed-data steps draw only continuations at least the horizon long, so every document trains
    # exactly the horizon's tokens, as a rollout with stop_at_eos false does: a teacher-forced
    # control that trains as many tokens on the same prompts as its on-policy run
    # (bench/real/opd_arm.py). The draws are those of the on-policy run when every continuation
    # is long enough
    fixed_full_horizon: bool = False

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
        _positive("rollout_state_write_every", self.rollout_state_write_every)
        _positive("temperature", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not self.prompt_sets:
            fail("prompt_sets", "empty: give at least one prompt set")
        names = [p.name for p in self.prompt_sets]
        if len(set(names)) != len(names):
            fail("prompt_sets", f"duplicate names in {names}")
        if not any(p.start_step == 0 and p.min_horizon <= self.horizon_start
                   for p in self.prompt_sets):
            fail("prompt_sets", "no set is active at step 0 with horizon_start="
                 f"{self.horizon_start} (start_step 0 and min_horizon <= horizon_start)")
        for name in ("rnn_lr", "attn_lr", "other_lr"):
            if getattr(self, name) is not None:
                _learning_rate(name, getattr(self, name))
        _non_negative("snapshot_every", self.snapshot_every)
        _non_negative("eval_every", self.eval_every)
        if self.eval_horizon is not None:
            _positive("eval_horizon", self.eval_horizon)
        for name in ("beta", "lmbda"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                fail(name, f"must be in [0, 1], got {getattr(self, name)}")
        if self.fixed_full_horizon and self.lmbda >= 1.0:
            fail("fixed_full_horizon", "applies to fixed-data steps, and lmbda=1 samples rollouts "
                                       "at every step: set opd.lmbda < 1")
        if self.lmbda < 1.0:
            missing = [p.name for p in self.prompt_sets
                       if p.kind == "jsonl" and p.completion_field is None]
            if missing:
                fail("prompt_sets",
                     f"lmbda={self.lmbda} trains some steps on the prompt sets' fixed "
                     f"continuations, but the jsonl set(s) {missing} have no completion_field")
