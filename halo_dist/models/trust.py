"""Which model folders may run their own Python code (``trust_remote_code``).

A folder that halo_dist exported carries our HypeNet files, and transformers needs
``trust_remote_code`` to import them. We trust such a folder without asking only when every ``.py``
in it is one of ours, byte for byte the file this installation would export, and every ``auto_map``
entry names our classes. Any other folder that carries code (a ``.py`` file, an ``auto_map`` in
``config.json`` or ``tokenizer_config.json``) runs it only with the user's explicit
``--trust-remote-code`` / ``model.trust_remote_code: true``, as in transformers; without it the
command stops and says why.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

from ..errors import HaloUserError
from .export import AUTO_MAP, MODEL_FILES

SOURCE = Path(__file__).parent / "hypenet"
CONFIG_FILES = ("config.json", "tokenizer_config.json")


class UntrustedCodeError(HaloUserError, ValueError):
    """A folder carries code that halo_dist did not write, and the user did not allow remote
    code."""


@lru_cache(maxsize=None)
def _our_digest(name: str) -> str:
    return hashlib.sha256((SOURCE / name).read_bytes()).hexdigest()


def _auto_maps(folder: Path) -> dict[str, object]:
    maps = {}
    for name in CONFIG_FILES:
        path = folder / name
        if path.is_file():
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and data.get("auto_map"):
                maps[name] = data["auto_map"]
    return maps


def carried_code(folder: str | Path) -> list[str]:
    """What in ``folder`` would run as code: its ``.py`` files and the files that hold an
    ``auto_map``."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.glob("*.py")) + [f"{n} auto_map"
                                                          for n in _auto_maps(folder)]


def is_halo_folder(folder: str | Path) -> bool:
    """Every ``.py`` is one of our model files with this installation's content, and the auto_maps
    name only our classes (config.json) or nothing (tokenizer_config.json)."""
    folder = Path(folder)
    files = list(folder.glob("*.py"))
    if not files:
        return False
    for f in files:
        if (f.name not in MODEL_FILES
                or hashlib.sha256(f.read_bytes()).hexdigest() != _our_digest(f.name)):
            return False
    maps = _auto_maps(folder)
    ours = set(AUTO_MAP.values())
    config_map = maps.pop("config.json", {})
    return not maps and isinstance(config_map, dict) and set(map(str, config_map.values())) <= ours


def trust_for(folder: str | Path, explicit: bool = False) -> bool:
    """``trust_remote_code`` for loading ``folder``: True if the user allowed it or the folder is
    ours;
    False if it carries no code (or is a hub id); raises UntrustedCodeError otherwise."""
    if explicit:
        return True
    code = carried_code(folder)
    if not code:
        return False
    if is_halo_folder(folder):
        return True
    raise UntrustedCodeError(
        f"{folder} carries code that halo_dist did not write ({', '.join(code)}); it runs only if "
        "you trust it: pass --trust-remote-code (or set model.trust_remote_code: true). Folders "
        "exported by another halo_dist version count as foreign too: re-export them, or pass the "
        "flag.")


def check_model_sources(cfg) -> None:
    """Before a run builds anything: every model and tokenizer its config names can be read here
    (``config.sources.source_problem``), and the teacher and ``student_init`` folders carry no code
    that :func:`trust_for` would refuse once they are loaded (the stages load their tokenizers,
    and write them into the export, only after training)."""
    from ..config.sources import source_problem
    from ..errors import MissingInputError

    m = cfg.model
    pretrain_tok = cfg.pretrain.model.tokenizer if cfg.pretrain is not None else None
    opd_tok = cfg.opd.tokenizer if cfg.opd is not None and cfg.opd.tokenizer != "bytes" else None
    # the bundled teacher (smollm2) is built from a package, not read from a path or the hub
    teacher = m.teacher if m.teacher not in (None, "random", "smollm2") else None
    sources = [("model.teacher", teacher, "config.json"),
               ("model.student_init", m.student_init, "config.json"),
               ("opd.tokenizer", opd_tok, "tokenizer_config.json"),
               ("pretrain.model.tokenizer", pretrain_tok, "tokenizer_config.json")]
    for key, name, needs in sources:
        problem = name and source_problem(key, name, needs)
        if problem:
            raise MissingInputError(problem)
    for key, name in (("model.teacher", teacher), ("model.student_init", m.student_init)):
        if name:
            try:
                trust_for(name, m.trust_remote_code)
            except UntrustedCodeError as e:
                raise UntrustedCodeError(f"{key}: {e}") from None


def load_tokenizer(folder: str | Path, trust_remote_code: bool = False, **kwargs):
    """``AutoTokenizer.from_pretrained`` with :func:`trust_for`'s decision."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(folder), trust_remote_code=trust_for(folder, trust_remote_code), **kwargs)
