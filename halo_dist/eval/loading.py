"""Loading what the evaluation commands score: a model folder (HypeNet, any HF causal LM or
'smollm2') with its tokenizer, or only the tokenizer, plus the small argument parsers they share.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import EvalError


def load_model(name: str, device: str = "cpu", dtype: str = "fp32",
               convert_attn_layers: str | None = None, trust_remote_code: bool = False):
    """``(model, tokenizer, label)`` for a HypeNet folder, any HF causal LM folder, or 'smollm2'.

    With ``convert_attn_layers`` the (teacher) model is converted to an untrained HypeNet first.
    """
    from ..teacher import teacher_path
    from ..models.convert import resolve_teacher

    source = resolve_teacher(teacher_path(name), "--model")
    tokenizer = try_tokenizer(source.path, source.load_kwargs(), trust_remote_code)
    if tokenizer is None:
        raise EvalError(f"{name} has no tokenizer: NIAH and lm-eval need one in the model folder")
    torch_dtype = parse_dtype(dtype)
    model = _load_causal_lm(source, torch_dtype)
    label = name
    if convert_attn_layers:
        from ..models.convert import convert_model

        layers = parse_int_list(convert_attn_layers, "--convert-attn-layers")
        model = convert_model(model, layers)
        label = f"{name} -> HypeNet (untrained, attention {layers})"
    return model.to(device=device, dtype=torch_dtype).eval(), tokenizer, label


def load_tokenizer(name: str, trust_remote_code: bool = False):
    """The tokenizer of a model or tokenizer folder (or 'smollm2'), without loading a model."""
    from ..teacher import teacher_path
    from ..models.convert import resolve_teacher

    path = Path(teacher_path(name))
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        # a tokenizer folder needs no weights
        tokenizer = try_tokenizer(str(path), {}, trust_remote_code)
    else:
        source = resolve_teacher(str(path), "--model")
        tokenizer = try_tokenizer(source.path, source.load_kwargs(), trust_remote_code)
    if tokenizer is None:
        raise EvalError(f"{name} has no tokenizer files")
    return tokenizer


def _load_causal_lm(source, dtype):
    config_path = Path(source.path) / "config.json"
    if config_path.is_file() and json.loads(config_path.read_text()).get("model_type") == "hypenet":
        from ..models.hypenet import HypeNetForCausalLM

        return HypeNetForCausalLM.from_pretrained(source.path, dtype=dtype)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, **source.load_kwargs())


def try_tokenizer(path: str, kwargs: dict, trust_remote_code: bool = False):
    """The folder's tokenizer (pad = EOS when it has none), or None when it has no usable one; a
    folder whose code is not trusted still raises."""
    from ..models.trust import UntrustedCodeError, load_tokenizer

    try:
        # our HypeNet folders: trusted by content
        tok = load_tokenizer(path, trust_remote_code, **kwargs)
    except UntrustedCodeError:
        raise
    except Exception:  # noqa: BLE001 - no tokenizer files (e.g. a bare test teacher)
        return None
    if len(tok) < 2 or not tok("hello world", add_special_tokens=False)["input_ids"]:
        return None  # transformers 5 builds an empty tokenizer for a folder without tokenizer files
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def parse_dtype(name: str):
    """``fp32`` / ``bf16`` / ``fp16`` -> the torch dtype."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def parse_int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(t) for t in str(text).replace("[", "").replace("]", "").split(",") if t.strip()]
    except ValueError:
        raise EvalError(f"{flag} must be comma-separated integers, got {text!r}") from None
