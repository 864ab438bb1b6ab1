"""Stage ``pretrain``: a randomly initialised HypeNet-family model trained from scratch with CE.

The from-scratch sweeps (paper §6.3, App. H) are three architectures, all expressed as the
HypeNet model so one set of kernels, SP, checkpoints and exports serves them:

  transformer  every layer softmax attention with RoPE (θ = pretrain.model.rope_theta)
  swan         SWAN-GPT: sliding-window attention (pretrain.sliding_window, RoPE) in every layer
               except model.attn_layers, which are full attention without RoPE (NoPE)
  hypenet      attention at model.attn_layers (default every 4th from 0: Attn->RNN->RNN->RNN), the
               RNN mixer model.rnn_mixer elsewhere, position encoding model.pe:
               hype = RNN RoPE + attention NoPE | all_rope | all_nope | attn_rope_rnn_nope

The variant is ``pretrain.arch``, the shape ``pretrain.model``; the HypeNet switches (mixer,
position encoding, attention layers, gates) are ``model:``'s, as for the distilled students.
Logits scaling (model.logits_scaling_a) applies to the full-attention layers as in every stage.

What is reused: the loop, checkpoints, exact resume, metrics and DeepSpeed set-up are the engine's
(``halo_dist.train.trainer.Trainer``); the loss is the fused chunked CE of ``halo_dist.losses`` via
``StudentWithLoss(objective="ce", teacher=None)``, which never materialises ``[tokens x vocab]``
logits. ``halo_dist.train.pretrain_trainer.PretrainTrainer`` changes only what from-scratch training
needs: parameter groups (weight decay on matrices only), model FLOPs with attention terms for MFU,
the tokenizer check.

Initialisation (GPT-2 / Megatron practice): embeddings and every linear weight ~ N(0, σ²) with
σ = pretrain.model.init_std (0.02), the residual-branch output projections (mixer ``o_proj``, MLP
``down_proj``) ~ N(0, σ² / 2L) so the residual stream's variance does not grow with depth L, biases
0, RMSNorm weights 1, and the 2·sigmoid output gates of attention / Lightning layers W_z = 0 (gate
exactly 1 at step 0, as in conversion). Mixers with their own parameters (decays, low-rank gates)
keep the init their class gives them.

Weight decay (AdamW, optim.weight_decay = 0.1 in the sweeps) applies to matrices only: parameters
with at least two dimensions larger than 1, except embedding tables (and so a tied lm_head).
Embeddings, norm weights, biases and per-channel vectors (decays, scales) are not decayed: decaying
them pulls gains toward 0 and rare-token embeddings toward the origin without regularising anything.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import torch
from torch import nn

from ..config import PE_ROPE, RunConfig, to_dict
from ..config.coerce import ConfigError
from ..models.flops import flops_per_token
from ..models.hypenet import HypeNetConfig, HypeNetForCausalLM
from .distill import StudentWithLoss

DEFAULT_SLIDING_WINDOW = 512  # SWAN-GPT's window (paper Table 13)
DEFAULT_ATTN_EVERY = 4  # Attn -> RNN -> RNN -> RNN (paper App. H.2)
OUTPUT_PROJECTIONS = ("mixer.o_proj", "mlp.down_proj")


# ---------------------------------------------------------------------------------------- model
def mixer_types(cfg: RunConfig) -> list[str]:
    """Per-layer mixer names (``HypeNetConfig.mixer_types``) of the configured variant."""
    m, arch, depth = cfg.model, cfg.pretrain.arch, cfg.pretrain.model.num_hidden_layers
    if arch == "transformer":
        return ["attention"] * depth
    attn = set(m.attn_layers) if m.attn_layers else set(range(0, depth, DEFAULT_ATTN_EVERY))
    other = "swa" if arch == "swan" else m.rnn_mixer
    return ["attention" if i in attn else other for i in range(depth)]


def check_mixers_available(types: list[str]) -> None:
    """Refuse a variant whose mixer has no implementation in this checkout, naming the config
    key."""
    from ..models.hypenet.modeling_hypenet import MIXER_CLASSES

    missing = sorted(set(types) - set(MIXER_CLASSES))
    if missing:
        key = ("pretrain.arch=swan (mixer 'swa')" if missing == ["swa"]
               else f"model.rnn_mixer={'/'.join(missing)}")
        raise ConfigError(f"{key}: no implementation of mixer {', '.join(map(repr, missing))} in "
                          f"this checkout (HypeNet mixers available: {', '.join(MIXER_CLASSES)})")


def hypenet_kwargs(cfg: RunConfig) -> dict:
    """``HypeNetConfig`` keyword arguments of the configured from-scratch variant."""
    m, p, s = cfg.model, cfg.pretrain, cfg.pretrain.model
    if p.arch == "transformer":
        attn_rope, rnn_rope = True, True
    elif p.arch == "swan":
        attn_rope, rnn_rope = False, True  # full layers NoPE; the SWA layers' RoPE is swa_rope
    else:
        attn_rope, rnn_rope = PE_ROPE[m.pe or "hype"]
    kw = dict(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads, head_dim=s.head_dim, rope_theta=s.rope_theta,
        max_position_embeddings=s.max_position_embeddings,
        tie_word_embeddings=s.tie_word_embeddings,
        mixer_types=mixer_types(cfg), attn_rope=attn_rope, rnn_rope=rnn_rope,
        attn_logits_scale_base=m.logits_scaling_a if m.logits_scaling_in_training else None,
        attn_qk_norm=s.qk_norm, rnn_qk_norm=s.qk_norm, attn_output_gate=m.attn_output_gate,
        attn_output_norm=m.attn_output_norm, rnn_output_gate=True, rnn_gqa_to_mha=True,
        initializer_range=s.init_std,
    )
    if p.arch == "swan":
        kw.update(sliding_window=p.sliding_window or DEFAULT_SLIDING_WINDOW, swa_rope=True)
    return kw


def pretrain_config(cfg: RunConfig) -> HypeNetConfig:
    """The HypeNet config of the variant; a mixer without implementation is a clear error."""
    kw = hypenet_kwargs(cfg)
    check_mixers_available(kw["mixer_types"])
    return HypeNetConfig(**kw)


@torch.no_grad()
def init_pretrain_weights(model: HypeNetForCausalLM, std: float) -> None:
    """Scaled init of the residual outputs and unit gates on top of the model's own N(0, std²)
    init."""
    from ..models.hypenet.attention_hypenet import HypeNetAttention
    from ..models.hypenet.rnn_hypenet import LightningMixer

    out_std = std / math.sqrt(2 * model.config.num_hidden_layers)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.endswith(OUTPUT_PROJECTIONS):
            nn.init.normal_(module.weight, 0.0, out_std)
        if isinstance(module, (HypeNetAttention, LightningMixer)) and hasattr(module, "g_proj"):
            nn.init.zeros_(module.g_proj.weight)  # gate = 2 sigmoid(0) = 1


def build_pretrain_model(cfg: RunConfig) -> HypeNetForCausalLM:
    """A randomly initialised model; the same weights on every rank (seeded, global RNG
    untouched)."""
    config = pretrain_config(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.pretrain.model.init_seed)
        model = HypeNetForCausalLM(config)
        init_pretrain_weights(model, cfg.pretrain.model.init_std)
    if cfg.model.activation_checkpointing:
        model.model.gradient_checkpointing = True
    return model


def build_pretrain_module(cfg: RunConfig):
    """``(StudentWithLoss with the CE objective and no teacher, None)``: stage pretrain's build,
    with the decoder layers compiled as ``model.compile`` says and the loss on ``loss.backend``."""
    from ..models.hypenet.modeling_hypenet import compile_decoder_layers

    model = compile_decoder_layers(build_pretrain_model(cfg), cfg.model.compile)
    module = StudentWithLoss(model, None, objective="ce", chunk_size=cfg.loss.chunk_size,
                             backend=cfg.loss.backend)
    return module, None


# ---------------------------------------------------------------------------------------- optimizer
def is_decayed(param: torch.Tensor, embedding_ids: set[int]) -> bool:
    """Matrices (>= 2 dims larger than 1) other than embedding tables get weight decay."""
    return sum(d > 1 for d in param.shape) >= 2 and id(param) not in embedding_ids


def param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: ``decay`` (matrices) and ``no_decay`` (embeddings, norms, biases,
    vectors)."""
    embedding_ids = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in module.parameters():  # parameters() yields a tied weight once
        if p.requires_grad:
            (decay if is_decayed(p, embedding_ids) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]


# ---------------------------------------------------------------------------------------- FLOPs
def train_flops_per_token(config: HypeNetConfig, n_params: int, seq_len: int,
                          full_attention_keys: float | None = None) -> float:
    """Model FLOPs per trained token: 6 N + attention scores (``metrics.flops_per_token``, PaLM App.
    B).

    N counts the lm_head but not the input embedding (tied: the one matrix counts once). Full
    attention layers attend ``full_attention_keys`` keys (default ``seq_len``; the trainer passes 0
    and adds the measured keys per batch), SWA layers ``min(window, seq_len)``; RNN state updates
    are not counted. ``n_params``: unique parameters of the model (embedding included).
    """
    n = n_params - (0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size)
    types = list(config.mixer_types)
    attn_dim = config.num_attention_heads * config.head_dim
    window = min(int(getattr(config, "sliding_window", None) or seq_len), seq_len)
    swa = flops_per_token(0, attn_layers=types.count("swa"), attn_dim=attn_dim, context=window)
    keys = seq_len if full_attention_keys is None else full_attention_keys
    return flops_per_token(n, attn_layers=types.count("attention"), attn_dim=attn_dim,
                           context=keys) + swa


def unique_numel(module: nn.Module) -> int:
    """Parameters of ``module`` (ZeRO-3 partitioned ones by their full size), shared ones once."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())


# -------------------------------------------------------------------------------- tokenizer, output
def load_tokenizer(cfg: RunConfig):
    """The configured tokenizer, or None (not set, or not loadable here: a warning, no failure)."""
    name = cfg.pretrain.model.tokenizer
    if not name:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        print(f"warning: tokenizer {name} not loadable ({type(err).__name__}): shards "
              "are not checked against it and the exported model has no tokenizer files",
              file=sys.stderr, flush=True)
        return None


def checked_tokenizer(cfg: RunConfig):
    """pretrain.model.tokenizer, if it loads, refused when the model cannot embed its ids."""
    tok, shape = load_tokenizer(cfg), cfg.pretrain.model
    if tok is not None and len(tok) > shape.vocab_size:
        raise ConfigError(f"pretrain.model.vocab_size={shape.vocab_size} is smaller than the "
                          f"tokenizer's {len(tok)} tokens ({shape.tokenizer})")
    return tok


def write_pretrain_output(trainer, folder: Path) -> Path | None:
    """An HF HypeNet folder (+ tokenizer) under ``folder``. Rank 0 writes; all ranks call.

    The exported config always carries ``model.logits_scaling_a``, also when it was off in training
    (``logits_scaling_in_training=false``: the reference code's inference-only scaling).
    """
    from ..models.export import write_hf_folder
    from .output import gathered_state_dict, run_record, stage_inputs

    state = gathered_state_dict(trainer)
    if trainer.rank != 0:
        return None
    cfg = trainer.cfg
    config = copy.deepcopy(trainer.module.student.config)
    config.attn_logits_scale_base = cfg.model.logits_scaling_a
    tokenizer = load_tokenizer(cfg)
    if tokenizer is not None and config.eos_token_id is None:
        config.eos_token_id = tokenizer.eos_token_id
    record = run_record(cfg, trainer.step, trainer.tokens_seen, trainer.metrics,
                        seq_len=cfg.data.seq_len, arch=cfg.pretrain.arch, pe=cfg.model.pe,
                        rnn_mixer=cfg.model.rnn_mixer)
    return write_hf_folder(state, config, folder, tokenizer=tokenizer, record=record,
                           run_config=to_dict(cfg), overwrite=True, inputs=stage_inputs(cfg))


# ---------------------------------------------------------------------------------------- --check
def describe_plan(cfg: RunConfig) -> str:
    """The layer plan and position encodings of the variant (no model needed)."""
    kw = hypenet_kwargs(cfg)
    plan = " ".join({"attention": "A", "swa": "S"}.get(t, "R") for t in kw["mixer_types"])
    rnn = f", R {cfg.model.rnn_mixer}" if cfg.pretrain.arch == "hypenet" else ""
    extra = f" sliding_window={kw['sliding_window']}" if "sliding_window" in kw else ""
    return (f"# model: arch={cfg.pretrain.arch}; layers (A attention, S sliding-window "
            f"attention{rnn}): {plan}\n#   attn_rope={kw['attn_rope']} rnn_rope={kw['rnn_rope']} "
            f"logits_scaling_a={kw['attn_logits_scale_base']} "
            f"attn_output_gate={kw['attn_output_gate']}{extra}\n")


def describe_size(cfg: RunConfig) -> str:
    """Parameters and training FLOPs of the variant, from a meta-device model (nothing allocated).
    Raises ConfigError (a ValueError) for a mixer without implementation."""
    config = pretrain_config(cfg)
    with torch.device("meta"):
        model = HypeNetForCausalLM(config)
    n = unique_numel(model)
    fpt = train_flops_per_token(config, n, cfg.data.seq_len)
    return (f"#   parameters: {n / 1e6:.1f}M "
            f"({(n - config.vocab_size * config.hidden_size) / 1e6:.1f}M without the "
            f"input embedding); training FLOPs/token {fpt / 1e9:.2f}G, "
            f"whole run {fpt * cfg.tokens_per_step * cfg.total_steps:.3g}\n")


def check_flag(parser) -> None:
    parser.add_argument("--check", action="store_true",
                        help="validate the config and the variant (mixers implemented, layout with "
                             "--world-size), print the resolved config, layer plan, parameters and "
                             "FLOPs; allocate nothing")


def print_check(cfg: RunConfig, args) -> None:
    """``--check``: the resolved config and layout, the layer plan, then parameters and FLOPs (the
    last builds the model on the meta device and raises ConfigError for a mixer without
    implementation)."""
    from ..config import describe

    sys.stdout.write(describe(cfg, args.world_size) + describe_plan(cfg))
    sys.stdout.flush()
    sys.stdout.write(describe_size(cfg))
