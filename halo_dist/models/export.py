"""Export a HypeNet model as a self-contained Hugging Face folder.

The folder holds safetensors weights, ``config.json`` with an ``auto_map``,
``generation_config.json`` (the teacher's when given), the tokenizer (if given, with its chat
template), exactly our model files, a model card (``README.md``), the run record
(``halo_dist.json``) and the marker of an output of ours (``outputs.MARKER``: what lets a later
export replace it), so ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``
works in a fresh process without halo_dist installed. Nothing else (no teacher, no training code) is
written.

:func:`write_hf_folder` is the one path from trained weights (a state dict from a stage's module, a
DeepSpeed checkpoint or a live student) to such a folder; :func:`export_hypenet` writes one from a
built model.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import HaloUserError
from ..outputs import write_output
from .model_card import model_card

# the model classes import transformers: loaded when a model is built, not with this module
if TYPE_CHECKING:
    from .hypenet import HypeNetForCausalLM

# Every module of models/hypenet/ but its __init__.py (tests/test_hypenet.py checks that none is
# missing): the model code an export carries, importing only torch, transformers and these files.
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
    "decode_options.py",  # its options
    "decode_attention.py",  # its split-KV attention kernel
    "decode_lightning.py",  # its in-place Lightning state update
    "lightning_state.py",  # how that state is kept (bf16, deferred writes)
    "decode_gemv.py",  # its batch-1 GEMV
)
AUTO_MAP = {
    "AutoConfig": "configuration_hypenet.HypeNetConfig",
    "AutoModel": "modeling_hypenet.HypeNetModel",
    "AutoModelForCausalLM": "modeling_hypenet.HypeNetForCausalLM",
}
RECORD_FILE = "halo_dist.json"
DONE_FILE = "DONE"  # written last: a folder holding it is complete
# Key prefixes of the modules that wrap the model while training: DeepSpeed's engine, torch.compile,
# and our stage modules (StudentWithLoss / OPDModule hold the model as ``student``).
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "student.")


class ExportError(HaloUserError, ValueError):
    """Weights that cannot be exported (the message names the source and what is wrong)."""


def strip_wrapper_prefixes(state: dict, prefixes: tuple[str, ...] = WRAPPER_PREFIXES) -> dict:
    """``state`` with the model's own key names: leading wrapper prefixes (in any order, repeated)
    removed."""
    out = {}
    for key, value in state.items():
        stripped = True
        while stripped:
            stripped = False
            for prefix in prefixes:
                if key.startswith(prefix):
                    key, stripped = key[len(prefix):], True
        out[key] = value
    return out


def model_from_state(state: dict, config, source: str = "state dict") -> HypeNetForCausalLM:
    """``state`` (under any wrapper prefixes; keys the model does not have are ignored) as a HypeNet
    of fp32 CPU tensors, built by :func:`meta_model_with`."""
    weights = {k: v.detach().to("cpu", torch.float32) if v.is_floating_point() else v.detach().cpu()
               for k, v in strip_wrapper_prefixes(state).items()}
    return meta_model_with(weights, config, source)


def meta_model_with(weights: dict, config, source: str = "state dict") -> HypeNetForCausalLM:
    """A HypeNet built on the meta device (no random initialisation, no memory but the weights')
    that holds ``weights`` themselves (``assign``: same tensors, dtypes and devices).

    Tied weights are re-tied (``weights`` may hold ``lm_head.weight`` or not). Any weight still on
    the meta device afterwards is missing from ``weights``: :class:`ExportError` names them
    (``source`` says whose).
    """
    from .hypenet import HypeNetForCausalLM

    with torch.device("meta"):
        model = HypeNetForCausalLM(config)
    model.load_state_dict(weights, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    missing = [k for k, v in model.state_dict().items() if v.is_meta]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ExportError(f"{source}: missing {len(missing)} weight(s) of the model: "
                          f"{', '.join(missing[:5])}{more}")
    return model


def write_hf_folder(state: dict, config, output: str | os.PathLike, tokenizer=None,
                    record: dict | None = None, generation_config=None,
                    run_config: dict | None = None, source: str = "state dict",
                    overwrite: bool = False, inputs: dict | None = None) -> Path:
    """Trained weights -> a complete HF HypeNet folder at ``output``, atomically, ``DONE`` written
    last.

    ``state``: the model's weights under any wrapper prefixes; ``config``: its HypeNetConfig.
    ``record``: the run record (halo_dist.json, the model card, and the content of ``DONE``);
    ``run_config``: the resolved run config for ``run_config.json``; ``tokenizer`` /
    ``generation_config`` / ``overwrite`` / ``inputs`` as in :func:`export_hypenet`.
    Nothing is written when a weight is missing (:class:`ExportError`).
    """
    model = model_from_state(state, config, source)
    files = ({} if run_config is None
             else {"run_config.json": json.dumps(run_config, indent=2, default=str)})
    files[DONE_FILE] = json.dumps(record or {}, indent=2, default=str)
    return export_hypenet(model, output, tokenizer=tokenizer, extra=record,
                          generation_config=generation_config, files=files, overwrite=overwrite,
                          inputs=inputs)


def export_hypenet(model: HypeNetForCausalLM, output: str | os.PathLike,
                   tokenizer=None, extra: dict | None = None, generation_config=None,
                   files: dict[str, str] | None = None, overwrite: bool = False,
                   inputs: dict | None = None) -> Path:
    """Write the folder atomically (``outputs.write_output``: built in a hidden sibling, then
    renamed into place).

    ``extra``: the run record (stage, teacher, steps, tokens, held-out evaluation, ``history`` of
    the stages before) for halo_dist.json and the model card. ``generation_config``: the teacher's
    GenerationConfig, the export's generation defaults (default: the special tokens of the model's
    config). ``files``: name -> text, written last, in order, before the folder is renamed into
    place (e.g. a ``DONE`` marker).
    An existing ``output`` is replaced only when it is an earlier output of ours and ``overwrite``
    is set, and only after the new folder is complete; ``inputs`` (what the caller read, e.g.
    ``{"teacher": path}``) may not be, hold or lie inside ``output``.
    """
    def fill(tmp: Path) -> None:
        _write_model_folder(model, tmp, tokenizer, extra, generation_config)
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)

    own_generation = model.generation_config
    try:
        return write_output(output, fill, "hf-model", overwrite=overwrite, inputs=inputs)
    finally:
        model.generation_config = own_generation


def _write_model_folder(model: HypeNetForCausalLM, folder: Path, tokenizer, extra: dict | None,
                        generation_config) -> None:
    """Weights, config, our model files, the tokenizer, the run record and the model card."""
    model.config.auto_map = dict(AUTO_MAP)
    if generation_config is not None:
        model.generation_config = copy.deepcopy(generation_config)
    model.save_pretrained(folder, safe_serialization=True)
    src = Path(__file__).parent / "hypenet"
    for name in MODEL_FILES:
        shutil.copyfile(src / name, folder / name)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
        _drop_foreign_code(folder)
    if extra:
        (folder / RECORD_FILE).write_text(json.dumps(extra, indent=2, default=str))
    write_model_card(folder)


def write_model_card(folder: str | os.PathLike) -> Path:
    """``<folder>/README.md``, the model card, from what the folder holds: ``config.json`` as it is
    now (calibration rewrites ``a`` there after the export, and calls this again), the run record,
    the tokenizer and generation files. Replaced atomically, under the umask."""
    from transformers import GenerationConfig

    from ..outputs import write_text_atomic
    from .hypenet import HypeNetConfig

    folder = Path(folder)
    tok_config = _read_json(folder / "tokenizer_config.json")
    generation = (GenerationConfig.from_pretrained(folder).to_diff_dict()
                  if (folder / "generation_config.json").is_file() else {})
    card = model_card(HypeNetConfig.from_pretrained(folder), read_record(folder),
                      tokenizer=(folder / "tokenizer.json").is_file() or tok_config is not None,
                      chat_template=((folder / "chat_template.jinja").is_file()
                                     or bool((tok_config or {}).get("chat_template"))),
                      generation=generation)
    return write_text_atomic(folder / "README.md", card)


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_record(folder: str | os.PathLike) -> dict | None:
    """The run record an export carries (None for a folder halo_dist did not export, or an older
    export)."""
    return _read_json(Path(folder) / RECORD_FILE)


def load_generation_config(source: str | os.PathLike, **kwargs):
    """``source``'s generation_config.json as a GenerationConfig (a folder or a cached hub id), None
    without one."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(source), **kwargs)
    except (OSError, ValueError):
        return None


def _drop_foreign_code(folder: Path) -> None:
    """An export carries our model files only: a tokenizer loaded with remote code would save its
    own ``.py`` and an ``auto_map`` into tokenizer_config.json; both are removed (the tokenizer's
    files and vocabulary stay)."""
    for f in folder.glob("*.py"):
        if f.name not in MODEL_FILES:
            f.unlink()
    path = folder / "tokenizer_config.json"
    if path.is_file():
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.pop("auto_map", None) is not None:
            path.write_text(json.dumps(data, indent=2, ensure_ascii=False))
