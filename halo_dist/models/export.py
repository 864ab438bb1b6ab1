"""Export a HypeNet model as a self-contained Hugging Face folder.

The folder holds safetensors weights, ``config.json`` with an ``auto_map``, the tokenizer (if
given) and exactly our three model files, so
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` works in a fresh process
without halo_dist installed. Nothing else (no teacher, no training code) is written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from .hypenet import HypeNetForCausalLM

MODEL_FILES = ("configuration_hypenet.py", "modeling_hypenet.py", "ops_hypenet.py", "static_decode.py",
               "decode_attention.py")
AUTO_MAP = {
    "AutoConfig": "configuration_hypenet.HypeNetConfig",
    "AutoModel": "modeling_hypenet.HypeNetModel",
    "AutoModelForCausalLM": "modeling_hypenet.HypeNetForCausalLM",
}


def export_hypenet(model: HypeNetForCausalLM, output: str | os.PathLike, tokenizer=None, extra: dict | None = None) -> Path:
    """Write the folder atomically: build it in a sibling temp dir, then rename into place.

    An existing ``output`` is replaced only after the new folder is complete.
    """
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        model.config.auto_map = dict(AUTO_MAP)
        model.save_pretrained(tmp, safe_serialization=True)
        src = Path(__file__).parent / "hypenet"
        for name in MODEL_FILES:
            shutil.copyfile(src / name, tmp / name)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
            _drop_foreign_code(tmp)
        if extra:
            (tmp / "halo_dist.json").write_text(json.dumps(extra, indent=2, default=str))
        _replace_dir(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output


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
