"""On-policy distillation (OPAL): student rollouts scored by the frozen teacher.

One optimizer step:

1. **Rollouts.** The student samples continuations of curriculum prompts (temperature 1.0,
   top-p 1.0 by default) with HypeNet's cached batched ``generate`` (left padding is exact:
   padded keys masked, positions from the mask). A rollout ends at EOS (trained) or after
   ``horizon`` new tokens. Under DeepSpeed ZeRO-3 the loop samples from a gathered replica of
   the student (no collectives while decoding; ``opd.trainer`` explains why).
2. **Packing.** Each rollout becomes one document ``prompt + continuation`` (no padding) in a
   packed ``[1, L]`` row with ``cu_seqlens`` and per-document positions: the student and the
   teacher run their varlen kernels, as in stages 2/3.
3. **Loss.** Token-level reverse KL(student ‖ teacher) over the full vocabulary, fused and
   chunked (``halo_dist.losses.fused_distill_loss(beta=1)``, never ``[L, V]`` logits), or with
   ``opd.beta`` (``loss.objective: jsd``) TRL GKD's generalized JSD (0 = forward KL), on the
   positions that predict a *generated* token only (``loss_mask``: position j of a document is
   trained iff token j+1 was sampled). The teacher runs once over the packed
   sequences under ``no_grad``. The loss is split by position bucket of the predicted token
   (``[0, kl_bucket_min)``, then powers of two) so per-bucket KL sums come for free; the
   gradient is that of the sum.
4. **Reduction.** Token-weighted over micro-batches and data-parallel ranks: the generated-token
   count N is all-reduced before the forward, and every micro-batch's loss is its KL sum divided
   by ``N / G`` (G = ranks gradients are averaged over), so the update is the gradient of the
   global token mean whatever rank or micro-batch holds a token.

With ``opd.lmbda < 1`` (TRL GKD's on-policy fraction) a step is on-policy with probability lmbda,
decided by :func:`on_policy_step` from ``(opd.seed, step)`` alone: every rank makes the same choice
and a resumed run the same choices. The other steps skip step 1 and train on the prompt sets' fixed
continuations (``prompts.py``), cut to the horizon, packed and scored exactly like rollouts.

The horizon starts at ``horizon_start`` and doubles (up to ``horizon_max``) when the
:class:`PlateauDetector` says the reverse KL stopped improving. The training loop is
``halo_dist.opd.trainer``.
"""

from __future__ import annotations

import math
import random
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from transformers import GenerationConfig

from ..config.coerce import ConfigError
from ..errors import IncompatibleInputError
from ..losses import fused_distill_loss
from ..models.hypenet.cache_hypenet import STATIC_WARMUP_TOKENS, HypeNetCache
from ..models.hypenet.decode_options import DecodeOptions
from ..models.hypenet.generation_hypenet import _GENERATE_CACHE_KWARG
from ..models.hypenet.modeling_hypenet import eager_decoder_layers
from ..models.hypenet.static_decode import mixers_without_low_precision_state
from ..stages.build import check_same_vocab


# ------------------------------------------------------------------------------------------------
# Horizon schedule
# ------------------------------------------------------------------------------------------------


@dataclass
class PlateauDetector:
    """Says when a noisy, falling series (per-step reverse KL) has stopped improving.

    Values are averaged over windows of ``window`` steps. After each complete window its mean m is
    compared with the best window mean b seen so far (since the last reset): if
    ``m < b * (1 - min_rel_improvement)`` the window counts as an improvement (b <- m, the stale
    count resets), otherwise the stale count grows (b <- min(b, m)). The detector fires when
    ``patience`` consecutive windows did not improve, i.e. after at least
    ``window * (patience + 1)`` steps. Non-finite values are ignored. ``reset()`` forgets everything
    (a new horizon changes the KL's scale: later positions drift more).
    """

    window: int = 20
    patience: int = 2
    min_rel_improvement: float = 0.01
    best: float = math.inf
    stale: int = 0
    _sum: float = 0.0
    _count: int = 0
    windows: int = 0

    def update(self, value: float) -> bool:
        """Add one step's value; True when the series has plateaued (then the caller resets)."""
        if not math.isfinite(value):
            return False
        self._sum += value
        self._count += 1
        if self._count < self.window:
            return False
        mean = self._sum / self._count
        self._sum, self._count = 0.0, 0
        self.windows += 1
        if mean < self.best * (1.0 - self.min_rel_improvement):
            self.best, self.stale = mean, 0
        else:
            self.best = min(self.best, mean)
            self.stale += 1
        return self.windows > 1 and self.stale >= self.patience

    def reset(self) -> None:
        self.best, self.stale, self._sum, self._count, self.windows = math.inf, 0, 0.0, 0, 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


@dataclass
class HorizonSchedule:
    """Rollout horizon: ``start``, doubled on a plateau (no sooner than ``min_steps`` after a
    change), capped at ``max``."""

    start: int
    max: int
    detector: PlateauDetector
    min_steps: int = 0
    horizon: int = 0
    changed_at: int = 0
    history: list = field(default_factory=list)  # [(step, new horizon)]

    def __post_init__(self):
        self.horizon = self.horizon or self.start

    @classmethod
    def from_config(cls, opd) -> "HorizonSchedule":
        det = PlateauDetector(opd.plateau_window, opd.plateau_patience,
                              opd.plateau_min_rel_improvement)
        return cls(opd.horizon_start, opd.horizon_max, det, opd.min_steps_per_horizon)

    def update(self, step: int, kl: float) -> bool:
        """Feed the reverse KL of optimizer step ``step`` (1-based, after the update); True if the
        horizon doubled."""
        if self.horizon >= self.max:
            return False
        if not self.detector.update(kl) or step - self.changed_at < self.min_steps:
            return False
        self.horizon = min(self.max, self.horizon * 2)
        self.changed_at = step
        self.history.append((step, self.horizon))
        self.detector.reset()
        return True

    def state_dict(self) -> dict:
        return {"horizon": self.horizon, "changed_at": self.changed_at,
                "history": [list(h) for h in self.history], "detector": self.detector.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.horizon, self.changed_at = state["horizon"], state["changed_at"]
        self.history = [tuple(h) for h in state["history"]]
        self.detector.load_state_dict(state["detector"])


def position_buckets(first: int, horizon_max: int) -> list[tuple[int, int]]:
    """``[(0, first), (first, 2 first), (2 first, 4 first), ...]`` covering ``horizon_max``
    positions."""
    edges, hi = [(0, first)], first
    while hi < horizon_max:
        edges.append((hi, hi * 2))
        hi *= 2
    return edges


def bucket_tag(lo: int, hi: int) -> str:
    return f"train/kl_pos_{lo:05d}_{hi:05d}"


def on_policy_step(seed: int, step: int, lmbda: float) -> bool:
    """Whether optimizer step ``step`` (0-based) trains on student rollouts: probability ``lmbda``,
    a function of ``(seed, step)`` only (string seeds hash the same in every process)."""
    if lmbda >= 1.0:
        return True
    return lmbda > 0.0 and random.Random(f"{seed}:lmbda:{step}").random() < lmbda


# ------------------------------------------------------------------------------------------------
# Rollouts and packing
# ------------------------------------------------------------------------------------------------


@dataclass
class Rollout:
    prompt: list[int]
    completion: list[int]  # sampled tokens, up to and including EOS
    source: str = ""  # prompt set name


# compiled static rollouts: cache rooms are multiples of this (one compilation per room)
ROOM_MULTIPLE = 256


def compiled_room(tokens: int) -> int:
    """``tokens`` rounded up to a multiple of ``ROOM_MULTIPLE``: the KV room of a compiled static
    step, so that calls with similar prompts and the same horizon share one compilation."""
    return -(-tokens // ROOM_MULTIPLE) * ROOM_MULTIPLE


def static_options(compile_static: bool, decoder_options: DecodeOptions | None) -> DecodeOptions:
    """The rollout decoder's ``DecodeOptions``: ``decoder_options`` (None: the defaults), its step
    compiled when ``compile_static``."""
    options = decoder_options or DecodeOptions()
    return options.replace(compile=True) if compile_static else options


def rollout_decoder_options(opd, student_config) -> DecodeOptions:
    """``StaticDecoder`` options for the rollouts' Lightning states from ``opd.rollout_state_dtype``
    and ``opd.rollout_state_write_every`` (empty: the defaults), refused up
    front for a student with RNN layers other than Lightning (only its in-place decode kernel
    keeps a narrower state or defers its writes)."""
    dtype = {"float32": None, "bfloat16": torch.bfloat16}[opd.rollout_state_dtype]
    options = DecodeOptions(state_dtype=dtype, state_write_every=opd.rollout_state_write_every)
    other = mixers_without_low_precision_state(student_config.mixer_types)
    if options != DecodeOptions() and other:
        raise ConfigError(f"opd.rollout_state_dtype={opd.rollout_state_dtype} and "
                          f"opd.rollout_state_write_every={opd.rollout_state_write_every} need a "
                          f"student whose RNN layers are all Lightning; this one has {other}")
    return options


def left_padded(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one left-padded batch: ids and attention mask, both ``[B, longest prompt]``."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[b, width - len(p):] = 1
    return ids, mask


@torch.no_grad()
def sample_rollouts(model, prompts: list[list[int]], horizon: int, *, temperature: float = 1.0,
                    top_p: float = 1.0, eos_token_id: int | None = None, pad_token_id: int = 0,
                    stop_at_eos: bool = True, generator: torch.Generator | None = None,
                    static_cache: bool = False, compile_static: bool = False,
                    decoder_options: DecodeOptions | None = None) -> list[list[int]]:
    """Sampled continuations (token lists, cut after the first EOS when ``stop_at_eos``) from the
    student's own distribution under ``temperature`` / ``top_p`` only: the model's generation
    defaults stay out (an export carries its teacher's chat defaults, e.g. a top-k or a repetition
    penalty).

    ``generator``: the draws come from a seed taken from it (see ``_sampling_seeded_by``).
    ``static_cache``: decode through ``StaticDecoder`` (a CUDA-graph replay per token on CUDA).
    ``compile_static``: its step through ``torch.compile`` first (fuses the step's ~1,000 small
    kernels). It compiles once per rollout count, padding or not, and cache room; the room is
    rounded up by ``compiled_room`` so that prompts of similar width share a compilation.
    ``decoder_options``: the static decoder's Lightning state options (``rollout_decoder_options``:
    a narrower state, writes deferred). Layers compiled for training
    (``model.compile``) run eagerly here.
    """
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("an empty prompt cannot be continued")
    device = next(model.parameters()).device
    ids, mask = left_padded(prompts, pad_token_id)
    width = ids.shape[1]
    early = stop_at_eos and eos_token_id is not None
    was_training, defaults = model.training, model.generation_config
    model.eval()
    model.generation_config = GenerationConfig()
    cache = {"cache_implementation": "static" if static_cache else None}
    options = static_options(compile_static, decoder_options)
    if static_cache and options != DecodeOptions():
        room = width + horizon + STATIC_WARMUP_TOKENS
        cache = {_GENERATE_CACHE_KWARG: HypeNetCache(
            model.config.num_hidden_layers, static=True, static_options=options,
            max_cache_len=compiled_room(room) if compile_static else room)}
    try:
        with _sampling_seeded_by(generator, device), eager_decoder_layers(model):
            out = model.generate(ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=horizon, do_sample=True, temperature=temperature,
                                 top_p=top_p, top_k=0, eos_token_id=[eos_token_id] if early else [],
                                 pad_token_id=pad_token_id, **cache)
    finally:
        model.train(was_training)
        model.generation_config = defaults
    gen = out[:, width:].cpu().tolist()
    if stop_at_eos and eos_token_id is not None:
        gen = [row[: row.index(eos_token_id) + 1] if eos_token_id in row else row for row in gen]
    return gen


@contextmanager
def _sampling_seeded_by(generator: torch.Generator | None, device: torch.device):
    """``generate`` samples from the default RNG of ``device``: run it on a seed drawn from
    ``generator`` (so a rank's rollouts follow its generator, whose state the checkpoints keep) and
    restore that RNG afterwards."""
    if generator is None:
        yield
        return
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        yield


@dataclass
class PackedRollouts:
    """Rollouts packed into one ``[1, L]`` row (varlen), plus which positions are trained."""

    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L]
    cu_seqlens: torch.Tensor  # int32 [n + 1]
    max_seqlen: int
    loss_mask: torch.Tensor  # [L] bool: position j predicts a sampled token j + 1 of its document
    # [L] long: index of that sampled token in its continuation (-1 elsewhere)
    gen_index: torch.Tensor
    num_generated: int

    def to(self, device) -> "PackedRollouts":
        return PackedRollouts(self.input_ids.to(device), self.position_ids.to(device),
                              self.cu_seqlens.to(device),
                              self.max_seqlen, self.loss_mask.to(device), self.gen_index.to(device),
                              self.num_generated)


def pack_rollouts(rollouts: list[Rollout]) -> PackedRollouts:
    """Concatenate ``prompt + completion`` documents; rollouts with no sampled token are dropped."""
    ids, pos, mask, gidx, cu = [], [], [], [], [0]
    for r in rollouts:
        if not r.completion:
            continue
        doc = list(r.prompt) + list(r.completion)
        P, n = len(r.prompt), len(doc)
        ids += doc
        pos += range(n)
        # position j predicts token j + 1; sampled tokens are P .. n - 1
        mask += [P - 1 <= j <= n - 2 for j in range(n)]
        gidx += [j - (P - 1) if P - 1 <= j <= n - 2 else -1 for j in range(n)]
        cu.append(cu[-1] + n)
    if len(cu) == 1:
        raise ValueError("no rollout has a sampled token to train on")
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    return PackedRollouts(
        torch.tensor([ids], dtype=torch.long), torch.tensor([pos], dtype=torch.long),
        torch.tensor(cu, dtype=torch.int32), max(lens), torch.tensor(mask, dtype=torch.bool),
        torch.tensor(gidx, dtype=torch.long), int(sum(mask)),
    )


# ------------------------------------------------------------------------------------------------
# The trainable module
# ------------------------------------------------------------------------------------------------


class OPDModule(nn.Module):
    """Student + loss in one module (DeepSpeed sees one forward; ZeRO-3 gathers the lm_head)."""

    def __init__(self, student, teacher, temperature: float = 1.0, chunk_size: int | None = None,
                 buckets: list[tuple[int, int]] | None = None, beta: float = 1.0):
        super().__init__()
        self.student = student
        self._teacher = [teacher]  # frozen, never saved: not a submodule
        self.temperature, self.chunk_size = temperature, chunk_size
        self.beta = beta  # the generalized JSD's interpolation: 1 = reverse KL
        self.buckets = buckets or [(0, 1 << 62)]

    @property
    def teacher(self):
        return self._teacher[0]

    def student_model(self):
        return self.student

    @property
    def student_config(self):
        """The student's config (recorded in checkpoints, as the stage modules'
        ``student_config``)."""
        return self.student.config

    def enable_zero3(self) -> None:
        import deepspeed

        deepspeed.zero.register_external_parameter(self, self.student.lm_head.weight)

    def forward(self, input_ids, position_ids, cu_seqlens, max_seqlen, loss_mask, gen_index,
                normalizer: float = 1.0, horizon: int | None = None):
        """Returns ``(loss for backward, detached divergence sum, token count, [per-bucket (sum,
        count)])``."""
        kw = dict(position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                  return_hidden_only=True)
        hidden = self.student(input_ids, **kw).flatten(0, 1)  # [1, L, d] -> [L, d]
        with torch.no_grad():
            t_hidden = self.teacher(input_ids, **kw).flatten(0, 1)
        loss = hidden.new_zeros((), dtype=torch.float32)
        kl_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        count = torch.zeros((), dtype=torch.int64, device=hidden.device)
        per_bucket = []
        for lo, hi in self.buckets:
            if horizon is not None and lo >= horizon:
                break
            m = loss_mask & (gen_index >= lo) & (gen_index < hi)
            out = fused_distill_loss(
                hidden, self.student.lm_head.weight, t_hidden, self.teacher.lm_head.weight,
                token_mask=m, beta=self.beta, temperature=self.temperature,
                normalizer=normalizer, chunk_size=self.chunk_size,
            )
            loss = loss + out.loss
            kl_sum = kl_sum + out.kl_sum
            count = count + out.num_tokens
            per_bucket.append((out.kl_sum, out.num_tokens))
        return loss, kl_sum, count, per_bucket


# ------------------------------------------------------------------------------------------------
# Parameter groups, tokenizer and vocabulary checks
# ------------------------------------------------------------------------------------------------


def parameter_groups(student, *, lr: float, rnn_lr=None, attn_lr=None, other_lr=None,
                     train_attention: bool = True) -> list[dict]:
    """AdamW groups ``rnn`` / ``attn`` / ``other`` with their peak LRs; frozen parameters excluded.

    Attention mixers are frozen when ``train_attention`` is false; a group whose LR is 0 is frozen.
    Each group's LR follows the run's schedule shape, scaled by ``group lr / optim.lr``.
    """
    kinds = student.config.mixer_types
    lrs = {"rnn": lr if rnn_lr is None else rnn_lr, "attn": lr if attn_lr is None else attn_lr,
           "other": lr if other_lr is None else other_lr}
    if not train_attention:
        lrs["attn"] = 0.0
    groups = {k: [] for k in lrs}
    for name, p in student.named_parameters():
        parts = name.split(".")
        kind = "other"
        if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] == "mixer":
            kind = "attn" if kinds[int(parts[2])] == "attention" else "rnn"
        if lrs[kind] == 0:
            p.requires_grad_(False)
        else:
            p.requires_grad_(True)
            groups[kind].append(p)
    out = [{"params": ps, "lr": lrs[k], "name": k} for k, ps in groups.items() if ps]
    if not out:
        raise ConfigError("every parameter group is frozen (opd.train_attention false and "
                          "opd.rnn_lr/other_lr 0)")
    return out


def tokenizer_fingerprint(tok) -> dict:
    """What must agree between teacher and student tokenizers: the vocabulary and special ids."""
    return {"vocab": tok.get_vocab(), "eos": getattr(tok, "eos_token_id", None)}


def check_tokenizers(teacher_tok, student_tok) -> None:
    """Refuse a student whose tokenizer differs from the teacher's (one token space is required)."""
    if student_tok is None or teacher_tok is None:
        return
    a, b = tokenizer_fingerprint(teacher_tok), tokenizer_fingerprint(student_tok)
    if a["vocab"] != b["vocab"]:
        only_t = len(set(a["vocab"].items()) - set(b["vocab"].items()))
        raise IncompatibleInputError(
            f"teacher and student tokenizers differ ({len(a['vocab'])} vs {len(b['vocab'])} "
            f"tokens, {only_t} teacher entries missing or re-numbered in the student's): on-policy "
            "distillation scores the student's tokens with the teacher, so both need one tokenizer")
    if a["eos"] != b["eos"]:
        raise IncompatibleInputError(f"teacher EOS id {a['eos']} != student EOS id {b['eos']}")


def check_vocab(student, teacher, tokenizer=None) -> None:
    """One vocabulary for both models, and a tokenizer whose ids fit it."""
    check_same_vocab(student, teacher)
    vs = student.config.vocab_size
    if tokenizer is not None:
        n = len(tokenizer)
        if n > vs:
            raise IncompatibleInputError(f"the tokenizer has {n} tokens but the models' vocabulary "
                                         f"is {vs}: wrong tokenizer")
