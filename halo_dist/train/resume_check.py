"""Is a resume the same run? The checkpoint's resolved config against the one about to run.

What defines the run must match, or the resume is refused with the list of differences: the stage,
the model (teacher, shape, attention layers, mixers, scaling, dtype, initial weights), stage
pretrain's variant, shape and init (the whole ``pretrain`` section), on-policy distillation's
``opd`` section, the data (shards, sequence length, global batch, seed, shuffling, held-out split)
and the objective; ``data.train`` by content: the same shards under another path are the same
data. What only changes how the run proceeds may differ and is printed: step counts and
schedule (checked on its own against the saved LR), optimizer settings (e.g. a lower LR after a
non-finite stop), logging, checkpoint and evaluation cadence, micro batch and workers, parallel
layout, compilation and activation checkpointing.

A checkpoint's config is read at today's layout: a key that ``RunConfig.MOVED_KEYS`` places in
another section is compared there, one in ``RunConfig.REMOVED_KEYS`` is left out (what it chose, the
trainer checks where it matters, e.g. OPD refuses a checkpoint of its removed torch backend; a value
other than the one ``RunConfig.REMOVED_KEYS_RUN_AS`` names is refused here), and a
key that is null on one side and absent on the other (an optional section or field the other side's
code does not write) is the same setting.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from ..config import ConfigError, RunConfig
from ..config.coerce import moved_to

UNSET = "<unset>"

MUST_MATCH = ("stage", "model", "data.train", "data.eval", "data.seq_len", "data.global_batch_size",
              "data.seed", "data.shuffle", "loss.objective", "loss.temperature", "loss.ce_weight",
              "eval.split", "opd", "pretrain")
# performance settings inside the sections above: they change speed and memory, not the trained
# function
MAY_CHANGE = ("model.compile", "model.activation_checkpointing")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and scalars are leaves."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _covered(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def compare(saved: dict, current: dict,
            same_content: Callable[[str], bool] | None = None) -> tuple[list[str], list[str]]:
    """``(refused, allowed)``: one ``key: saved -> current`` line per differing setting.
    ``same_content(key)``: whether a path setting that must match names the same content under
    another path (allowed then)."""
    flat = flatten(saved)
    # a removed setting no longer changes the run, unless it held a value today's code cannot run
    refused = [f"{key}: {flat[key]!r} -> removed (runs as {value!r})"
               for key, value in RunConfig.REMOVED_KEYS_RUN_AS.items()
               if key in flat and flat[key] != value]
    a = {moved_to(key, RunConfig.MOVED_KEYS) or key: value for key, value in flat.items()
         if key not in RunConfig.REMOVED_KEYS}
    b = flatten(current)
    allowed = []
    for key in sorted(set(a) | set(b)):
        old, new = a.get(key, UNSET), b.get(key, UNSET)
        if old == new or (old is None and key not in b) or (new is None and key not in a):
            continue
        line = f"{key}: {old!r} -> {new!r}"
        must = _covered(key, MUST_MATCH) and not _covered(key, MAY_CHANGE)
        if must and same_content is not None and same_content(key):
            must, line = False, f"{line} (the same shards)"
        (refused if must else allowed).append(line)
    return refused, allowed


def check_resume_config(checkpoint: Path, current: dict, announce: bool = True,
                        same_content: Callable[[str], bool] | None = None) -> list[str]:
    """Refuse (ConfigError) to resume ``checkpoint`` with a config that defines another run; return
    (and print, if ``announce``) the settings that changed and are allowed to (``same_content`` as
    in :func:`compare`)."""
    from ..config.resolved import _resolved_data

    path = checkpoint / "config.yaml"
    if not path.exists():
        raise ConfigError(f"{checkpoint} holds no config.yaml: cannot tell whether resuming "
                          "it continues the same run (start a new run folder, or move its "
                          "checkpoints away)")
    refused, allowed = compare(_resolved_data(path)["config"], current, same_content)
    if refused:
        raise ConfigError(f"refusing to resume {checkpoint}: the run it belongs to differs in\n  "
                          + "\n  ".join(refused)
                          + "\nUse the checkpoint's settings (its config.yaml), or start a new run "
                            "folder.")
    if allowed and announce:
        print(f"resuming {checkpoint.name} with changed settings:\n  " + "\n  ".join(allowed),
              flush=True)
    return allowed


def check_same_run(checkpoint: Path, cfg, teacher_files: dict, announce: bool = True) -> None:
    """Before anything is built: resuming ``checkpoint`` continues its run, or is refused: the
    config (:func:`check_resume_config`) and the teacher's weights by content
    (``halo_dist.teacher``)."""
    from ..config import to_dict
    from ..teacher import check_same_teacher
    from .checkpoint import TRAINER_STATE

    state = json.loads((checkpoint / TRAINER_STATE).read_text())
    check_resume_config(checkpoint, to_dict(cfg), announce=announce,
                        same_content=lambda key: key == "data.train" and _same_shards(state, cfg))
    check_same_teacher(state.get("teacher_files"), teacher_files, checkpoint)


def _same_shards(state: dict, cfg) -> bool:
    """Whether ``data.train`` holds the shards the checkpoint's loader read (their names, counts and
    checksums: the loader's fingerprint), wherever they lie now."""
    from ..data import data_fingerprint

    saved = (state.get("loader") or {}).get("fingerprint")
    return bool(saved) and saved == data_fingerprint(cfg.data.train, "train")
