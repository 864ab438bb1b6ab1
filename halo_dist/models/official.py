"""Import a HypeNet checkpoint of the authors' reference code (thunlp/hybrid-linear-attention,
``halo/``).

Their Hugging Face folders (written by their ``build_hf_ckpt.py``: ``config.json`` of their
``HypeNetConfig``, safetensors weights, their model code) become ours, with the same function:

* config: ``mixer_types`` ``attn`` / ``lightning-attn`` -> ``attention`` / ``lightning``; their
  ``lightning_use_rope`` / ``attn_use_rope`` / ``lightning_use_qk_norm`` /
  ``lightning_use_output_gate`` / ``attn_use_output_gate`` -> our ``rnn_rope`` / ``attn_rope`` /
  ``rnn_qk_norm`` / ``rnn_output_gate`` / ``attn_output_gate``; their attention always has q/k
  norms; ``lightning_nkv`` equal to the query heads is our ``rnn_gqa_to_mha``;
  ``attn_logits_scaling`` ``"<name> <a>"`` (a = 362 when the string has no number) is our
  ``attn_logits_scale_base`` a, null is none;
* their two numerical choices: the Lightning output RMSNorm over all heads at once
  (``rnn_output_norm="all_heads"``) and ALiBi's slopes as decays (``lightning_decay="alibi"``);
  their gates are plain sigmoids (``output_gate_scale=1``);
* weights: ``model.layers.i.self_attn.*`` -> ``model.layers.i.mixer.*``, with the attention gate
  ``o_gate`` and the Lightning gate ``z_proj`` both named ``g_proj`` here; everything else keeps its
  name.

What their config can express but ours cannot (short convolutions, another Lightning scale or head
shape, a constant query scale, RoPE scaling, biases, other mixers) is refused with the key named,
before any weight is read; a weight that maps nowhere, or a missing one, is refused too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .convert import ConversionError
from .hypenet import HypeNetConfig, HypeNetForCausalLM

MIXERS = {"attn": "attention", "lightning-attn": "lightning", "lightning_attn": "lightning"}
# their attention's base when attn_logits_scaling is a string without a number
DEFAULT_SCALING_BASE = 362.0
# our config keys copied unchanged from theirs (same meaning, same name)
SAME_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
             "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
             "bos_token_id", "eos_token_id", "pad_token_id")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ImportOfficialError(ConversionError):
    """A folder that is not a reference HypeNet checkpoint, or one with settings HypeNet cannot
    express."""


def _get(theirs: dict, key: str, default=None):
    value = theirs.get(key, default)
    return default if value is None and default is not None else value


def _checked_scaling_base(theirs: dict, mixers: list, H: int, Hkv: int, D: int) -> float | None:
    """Refuses every setting of theirs that HypeNet cannot express (all of them listed at once);
    returns the logits-scaling base ``a`` their ``attn_logits_scaling`` names (None: no scaling)."""
    problems = []

    def need(key: str, ok: bool, why: str) -> None:
        if not ok:
            problems.append(f"{key}={theirs.get(key)!r}: {why}")

    bad = sorted({m for m, ours in zip(theirs["mixer_types"], mixers) if ours is None})
    need("mixer_types", not bad, f"{bad} have no HypeNet counterpart (attn and lightning-attn do)")
    lightning = "lightning" in mixers
    if lightning:
        need("lightning_nh", _get(theirs, "lightning_nh", H) == H,
             f"Lightning heads must equal num_attention_heads={H}")
        need("lightning_nkv", _get(theirs, "lightning_nkv", Hkv) in (H, Hkv),
             f"Lightning KV heads must be num_attention_heads={H} or num_key_value_heads={Hkv}")
        need("lightning_head_dim", _get(theirs, "lightning_head_dim", D) == D,
             f"must equal head_dim={D}")
        need("lightning_scale", _get(theirs, "lightning_scale", "1/sqrt(d)") == "1/sqrt(d)",
             "HypeNet's Lightning layers scale by 1/sqrt(d)")
        need("lightning_use_short_conv", not theirs.get("lightning_use_short_conv", False),
             "HypeNet's Lightning layers have no short convolution")
        need("lightning_use_output_norm", theirs.get("lightning_use_output_norm", False),
             "HypeNet's Lightning layers always normalise their output")
        need("lightning_rope_scaling", not theirs.get("lightning_rope_scaling"),
             "RoPE scaling is not supported")
    need("rope_scaling", theirs.get("rope_scaling") in (None, {}) or
         (theirs["rope_scaling"] or {}).get("rope_type", "default") == "default",
         "RoPE scaling is not supported")
    need("attention_bias", not theirs.get("attention_bias", False),
         "biased projections are not supported")
    scaling = theirs.get("attn_logits_scaling")
    need("attn_logits_scaling", scaling is None or isinstance(scaling, str),
         "a constant query scale has no HypeNet switch (a string \"<name> <a>\" or null does)")
    base = None
    if isinstance(scaling, str):
        words = scaling.split()
        try:
            base = float(words[1]) if len(words) > 1 else DEFAULT_SCALING_BASE
        except ValueError:
            problems.append(f"attn_logits_scaling={scaling!r}: its second word must be the base a")
    if problems:
        raise ImportOfficialError("cannot import this checkpoint:\n  " + "\n  ".join(problems))
    return base


def official_config(theirs: dict) -> HypeNetConfig:
    """Our config for their ``config.json`` contents (every unsupported setting refused, key
    named)."""
    if theirs.get("model_type") != "hypenet" or "mixer_types" not in theirs:
        raise ImportOfficialError(f"config.json has model_type={theirs.get('model_type')!r} and "
                                  f"{'a' if 'mixer_types' in theirs else 'no'} mixer_types: not a "
                                  "HypeNet checkpoint")
    if "rnn_output_norm" in theirs or "attn_logits_scale_base" in theirs:
        raise ImportOfficialError("config.json is already a halo_dist HypeNet (it has our keys): "
                                  "load it directly")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "num_key_value_heads") if k not in theirs]
    if missing:
        raise ImportOfficialError(f"config.json lacks {missing}")
    H, Hkv = theirs["num_attention_heads"], theirs["num_key_value_heads"]
    D = _get(theirs, "head_dim", theirs["hidden_size"] // H)
    mixers = [MIXERS.get(m) for m in theirs["mixer_types"]]
    base = _checked_scaling_base(theirs, mixers, H, Hkv, D)

    kwargs = {k: theirs[k] for k in SAME_KEYS if theirs.get(k) is not None}
    kwargs.update(
        head_dim=D, mixer_types=mixers, qkv_bias=False, o_bias=False, mlp_bias=False,
        rnn_rope=bool(theirs.get("lightning_use_rope", True)),
        attn_rope=bool(theirs.get("attn_use_rope", True)), attn_logits_scale_base=base,
        rnn_qk_norm=bool(theirs.get("lightning_use_qk_norm", False)), attn_qk_norm=True,
        rnn_output_gate=bool(theirs.get("lightning_use_output_gate", False)),
        attn_output_gate=bool(theirs.get("attn_use_output_gate", False)), output_gate_scale=1.0,
        attn_output_norm=False, rnn_gqa_to_mha=_get(theirs, "lightning_nkv", Hkv) == H,
        rnn_output_norm="all_heads", lightning_decay="alibi",
    )
    try:
        return HypeNetConfig(**kwargs)
    except ValueError as e:
        raise ImportOfficialError(f"config.json: {e}") from None


def official_key(key: str, mixer_types: list[str]) -> str | None:
    """Our name of one of their weights; None for a weight that has no place in HypeNet."""
    parts = key.split(".")
    if parts[:2] != ["model", "layers"] or len(parts) < 6 or parts[3] != "self_attn":
        return key
    layer, name = int(parts[2]), parts[4]
    if layer >= len(mixer_types):
        return key  # no such layer: reported as a weight with no place
    kind = mixer_types[layer]
    if name == ("o_gate" if kind == "attention" else "z_proj"):
        name = "g_proj"
    elif name in ("o_gate", "z_proj") or (name == "o_norm" and kind == "attention"):
        return None
    return ".".join(["model", "layers", parts[2], "mixer", name, *parts[5:]])


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """``model.safetensors`` or the shards of ``model.safetensors.index.json``."""
    from safetensors.torch import load_file

    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return load_file(single)
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for shard in shards:
            out.update(load_file(folder / shard))
        return out
    raise ImportOfficialError(f"{folder} holds no model.safetensors (or "
                              "model.safetensors.index.json)")


def official_state_dict(theirs: dict[str, torch.Tensor],
                        cfg: HypeNetConfig) -> dict[str, torch.Tensor]:
    """Their weights under our names (a refused or missing weight raises, naming it)."""
    ours, unplaced, origin = {}, [], {}
    for key, value in theirs.items():
        new = official_key(key, cfg.mixer_types)
        if new is None:
            unplaced.append(key)
        else:
            ours[new], origin[new] = value, key
    if cfg.tie_word_embeddings:
        ours.pop("lm_head.weight", None)  # the same tensor as the embedding when tied
    with torch.device("meta"):
        expected = HypeNetForCausalLM(cfg).state_dict()
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    unplaced = sorted(unplaced + [origin[k] for k in set(ours) - set(expected)])
    missing = sorted(set(expected) - set(ours))
    wrong = [f"{k}: {tuple(ours[k].shape)} (HypeNet expects {tuple(v.shape)})"
             for k, v in expected.items() if k in ours and ours[k].shape != v.shape]
    if unplaced or missing or wrong:
        lines = ([f"weights with no place in HypeNet: {unplaced[:5]}"] if unplaced else []) + \
                ([f"weights missing: {missing[:5]}"] if missing else []) + wrong[:5]
        raise ImportOfficialError("the checkpoint's weights do not match its config:\n  "
                                  + "\n  ".join(lines))
    return ours


def import_official(folder: str | os.PathLike, output: str | os.PathLike | None = None,
                    overwrite: bool = False) -> HypeNetForCausalLM:
    """Their folder -> our model (and, with ``output``, our self-contained export with their
    tokenizer; an earlier export of ours there is replaced only with ``overwrite``)."""
    from ..outputs import check_output
    from .convert import build_student

    folder = Path(folder)
    inputs = {"checkpoint folder": folder}
    if output is not None:  # refused before any weight loads
        check_output(output, inputs, overwrite)
    if not (folder / "config.json").is_file():
        raise ImportOfficialError(f"{folder} has no config.json")
    theirs = json.loads((folder / "config.json").read_text())
    cfg = official_config(theirs)
    weights = read_safetensors(folder)
    dtypes = {t.dtype for t in weights.values() if t.is_floating_point()}
    model = build_student(cfg, official_state_dict(weights, cfg),
                          dtype=dtypes.pop() if len(dtypes) == 1 else None)
    if output is not None:
        from .export import export_hypenet

        tok = None
        if any((folder / name).is_file() for name in TOKENIZER_FILES):
            from transformers import AutoTokenizer

            # their tokenizer is the teacher's (no remote code)
            tok = AutoTokenizer.from_pretrained(folder)
        export_hypenet(model, output, tokenizer=tok,
                       extra={"imported_from": {"folder": str(folder.resolve()),
                                                "format": "thunlp/hybrid-linear-attention"}},
                       overwrite=overwrite, inputs=inputs)
    return model
