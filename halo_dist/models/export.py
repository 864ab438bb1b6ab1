"""Export a HypeNet model as a self-contained Hugging Face folder.

The folder holds safetensors weights, ``config.json`` with an ``auto_map``, ``generation_config.json`` (the
teacher's when given), the tokenizer (if given, with its chat template), exactly our model files, a model
card (``README.md``) and the run record (``halo_dist.json``), so
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` works in a fresh process without
halo_dist installed. Nothing else (no teacher, no training code) is written.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path

from .hypenet import HypeNetForCausalLM
from .model_card import model_card

# Every module of models/hypenet/ but its __init__.py (tests/test_hypenet.py checks that none is missing): the
# model code an export carries, importing only torch, transformers and these files.
MODEL_FILES = (
    "configuration_hypenet.py",  # HypeNetConfig (AutoConfig)
    "modeling_hypenet.py",  # decoder layer, HypeNetModel, HypeNetForCausalLM (AutoModel*)
    "layers_hypenet.py",  # norms, MLP, RoPE, gates, SequenceInfo
    "attention_hypenet.py",  # softmax-attention mixers
    "rnn_hypenet.py",  # RNN mixers
    "sequence_parallel_hypenet.py",  # the mixers' Ulysses wrapping
    "cache_hypenet.py",  # HypeNetCache
    "generation_hypenet.py",  # generate over HypeNetCache
    "ops_attention.py",  # attention kernel dispatch
    "ops_rnn.py",  # RNN kernel dispatch (fla on CUDA)
    "ops_rnn_torch.py",  # exact torch recurrences
    "static_decode.py",  # CUDA-graph decoding
    "decode_attention.py",  # its split-KV attention kernel
)
AUTO_MAP = {
    "AutoConfig": "configuration_hypenet.HypeNetConfig",
    "AutoModel": "modeling_hypenet.HypeNetModel",
    "AutoModelForCausalLM": "modeling_hypenet.HypeNetForCausalLM",
}
RECORD_FILE = "halo_dist.json"


def export_hypenet(model: HypeNetForCausalLM, output: str | os.PathLike, tokenizer=None, extra: dict | None = None,
                   generation_config=None) -> Path:
    """Write the folder atomically: build it in a sibling temp dir, then rename into place.

    ``extra``: the run record (stage, teacher, steps, tokens, held-out evaluation, ``history`` of the stages
    before) for halo_dist.json and the model card. ``generation_config``: the teacher's GenerationConfig, the
    export's generation defaults (default: the special tokens of the model's config).
    An existing ``output`` is replaced only after the new folder is complete.
    """
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    own_generation = model.generation_config
    try:
        model.config.auto_map = dict(AUTO_MAP)
        if generation_config is not None:
            model.generation_config = copy.deepcopy(generation_config)
        model.save_pretrained(tmp, safe_serialization=True)
        src = Path(__file__).parent / "hypenet"
        for name in MODEL_FILES:
            shutil.copyfile(src / name, tmp / name)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
            _drop_foreign_code(tmp)
        if extra:
            (tmp / RECORD_FILE).write_text(json.dumps(extra, indent=2, default=str))
        card = model_card(model.config, json.loads(json.dumps(extra, default=str)) if extra else None,
                          tokenizer=tokenizer is not None, chat_template=bool(getattr(tokenizer, "chat_template", None)),
                          generation=model.generation_config.to_diff_dict())
        (tmp / "README.md").write_text(card)
        _replace_dir(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        model.generation_config = own_generation
    return output


def read_record(folder: str | os.PathLike) -> dict | None:
    """The run record an export carries (None for a folder halo_dist did not export, or an older export)."""
    path = Path(folder) / RECORD_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def load_generation_config(source: str | os.PathLike, **kwargs):
    """``source``'s generation_config.json as a GenerationConfig (a folder or a cached hub id), None without one."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(source), **kwargs)
    except (OSError, ValueError):
        return None


def _drop_foreign_code(folder: Path) -> None:
    """An export carries our model files only: a tokenizer loaded with remote code would save its own
    ``.py`` and an ``auto_map`` into tokenizer_config.json; both are removed (the tokenizer's files and
    vocabulary stay)."""
    for f in folder.glob("*.py"):
        if f.name not in MODEL_FILES:
            f.unlink()
    path = folder / "tokenizer_config.json"
    if path.is_file():
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.pop("auto_map", None) is not None:
            path.write_text(json.dumps(data, indent=2, ensure_ascii=False))


def _replace_dir(new: Path, target: Path) -> None:
    """Swap ``new`` into ``target``; the old folder is removed only after the rename succeeded."""
    if target.exists():
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        os.replace(new, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, target)
