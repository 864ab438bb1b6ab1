"""The teacher's identity across a resume: the content of its files, not only its path.

The resume check compares configs, where the teacher is a path; another model saved under the same
path (a re-download, a fine-tune written over the folder) would go on silently with another teacher.
So a run records the sha256 of every file in a local teacher folder (config, weights, tokenizer) in
each checkpoint's trainer state, and a resume recomputes and compares them before anything is built.

Hashing reads the whole teacher once (about 1.4 s per GB, ``bench/bench_verify.py``: ~20 s for an 8B
bf16 teacher); the digests are cached in the run's checkpoint folder by file size and modification
time, so later starts of the same run read nothing unless a file changed. Random teachers are
defined by their config alone; hub ids resolve to a revision outside our control and are not hashed
(pin one).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..config import ConfigError
from ..data.shards import sha256_file

CACHE = "teacher_files.json"


def teacher_folder(model_cfg) -> Path | None:
    """The local folder (or the folder of a .gguf file) the teacher is read from; None for random
    teachers, from-scratch runs and hub ids."""
    from ..stages.teacher import teacher_path

    if not model_cfg.teacher or model_cfg.teacher == "random":
        return None
    path = Path(teacher_path(model_cfg.teacher))
    if path.is_file():
        return path.parent
    return path if path.is_dir() else None


def teacher_digests(folder: Path, cache_dir: Path | None = None) -> dict[str, str]:
    """``{file name: sha256}`` of the regular files in ``folder``; digests of files whose size and
    modification time are unchanged come from ``cache_dir/teacher_files.json``, which is
    rewritten."""
    cache_file = cache_dir / CACHE if cache_dir is not None else None
    cached = (json.loads(cache_file.read_text()) if cache_file is not None and cache_file.exists()
              else {})
    digests, fresh = {}, {}
    for f in sorted(folder.iterdir()):
        if not f.is_file() or f.name.startswith("."):
            continue
        stat = [f.stat().st_size, f.stat().st_mtime_ns]
        hit = cached.get(f.name)
        digests[f.name] = hit["sha256"] if hit and hit.get("stat") == stat else sha256_file(f)
        fresh[f.name] = {"stat": stat, "sha256": digests[f.name]}
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(fresh, indent=1))
        os.replace(tmp, cache_file)
    return digests


def run_teacher_digests(model_cfg, checkpoint_dir) -> dict[str, str] | None:
    """The digests a run records: rank 0 hashes the teacher folder (cached in ``checkpoint_dir``),
    every rank receives them; None where the teacher is not a local folder."""
    import torch.distributed as dist

    folder = teacher_folder(model_cfg)
    if folder is None:
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    box = [teacher_digests(folder, Path(checkpoint_dir)) if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def check_same_teacher(saved: dict[str, str] | None, current: dict[str, str] | None,
                       checkpoint: Path) -> None:
    """Refuse (ConfigError) a resume whose teacher files differ from those the checkpoint
    recorded."""
    if saved is None or current is None:
        return
    changed = [f"{name}: {'absent' if name not in current else current[name][:12]} now, "
               f"{'absent' if name not in saved else saved[name][:12]} in the checkpoint"
               for name in sorted(set(saved) | set(current))
               if saved.get(name) != current.get(name)]
    if changed:
        raise ConfigError(f"refusing to resume {checkpoint}: the teacher's files differ from those "
                          "it was trained with (sha256)\n  " + "\n  ".join(changed)
                          + "\nPoint model.teacher at the original teacher, or start a new run "
                            "folder.")
