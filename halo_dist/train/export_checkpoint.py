"""`halo-dist export`: consolidate a (ZeRO-3 sharded) training checkpoint into a usable artefact.

Stage 2/3 checkpoints become an HF HypeNet folder (loads with trust_remote_code, no halo_dist
needed); stage 1 checkpoints become the ``rnn_layers.safetensors`` file that conversion reads.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..models.export import ExportError  # the CLI reports it as a user error

EXAMPLE = (
    "examples:\n"
    "  halo-dist export --checkpoint runs/hypenet-2b/stage2/checkpoints/step-00020000 --output "
    "out/hypenet-2b-s2\n"
    "  halo-dist export --checkpoint runs/hypenet-2b/stage2/checkpoints --output out/latest   # "
    "newest that verifies\n")


def resolve_checkpoint(path: str | Path) -> Path:
    """``path`` if it is a checkpoint that verifies (refused if damaged), else the newest that
    verifies in the folder ``path`` (those skipped are printed)."""
    from .checkpoint import MARKER, find_resume, verify_or_refuse

    path = Path(path)
    if (path / MARKER).exists():
        verify_or_refuse(path)
        return path
    latest = find_resume(path, "auto")
    if latest is None:
        raise ExportError(f"{path} is neither a complete checkpoint (no {MARKER} marker) nor a "
                          "folder holding one")
    return latest


def consolidated_state(ckpt: Path) -> dict:
    """fp32 state dict of the trained module from DeepSpeed's shards (any ZeRO stage)."""
    from deepspeed.utils import zero_to_fp32

    from ..parallel.safe_load import forced_weights_only

    with forced_weights_only(str(ckpt)):  # its own loads would unpickle anything (safe_load's doc)
        return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent),
                                                                     tag=ckpt.name)


def export_checkpoint(checkpoint: str | Path, output: str | Path, overwrite: bool = False) -> Path:
    """The checkpoint's trained weights -> the folder ``output`` (stage 1: the RNN-layer file; else
    an HF folder); an earlier export of ours there is replaced only with ``overwrite``."""
    from ..models.export import write_hf_folder
    from ..models.hypenet import HypeNetConfig
    from ..outputs import check_output
    from ..stages.stage1 import save_stage1_weights, stage1_state_dict
    from .checkpoint import TRAINER_STATE

    ckpt = resolve_checkpoint(checkpoint)
    # the run folder around the checkpoint is an input too: --output RUN would replace it
    inputs = {"checkpoint": ckpt, "checkpoint folder": checkpoint}
    check_output(output, inputs, overwrite)  # before the shards are read
    state_file = ckpt / TRAINER_STATE
    if not state_file.exists():
        raise ExportError(f"{state_file} is missing: not a halo_dist checkpoint")
    meta = json.loads(state_file.read_text())
    # before the shards are read: a teacher folder with foreign code is refused here, not after
    # minutes of consolidation
    tokenizer = run_tokenizer(ckpt) if meta["stage"] != "stage1" else None
    weights = consolidated_state(ckpt)
    cfg_dict = dict(meta["student_config"])
    if meta["stage"] == "stage1":
        return save_stage1_weights(stage1_state_dict(weights), output,
                                   cfg_dict["num_hidden_layers"], meta.get("teacher", "?"),
                                   rnn_rope=cfg_dict.get("rnn_rope", True), overwrite=overwrite,
                                   inputs=inputs)
    config = HypeNetConfig(**{k: v for k, v in cfg_dict.items()
                              if k not in ("auto_map", "architectures")})
    record = {"stage": meta.get("stage", "checkpoint"), "step": meta["step"],
              "tokens": meta.get("tokens_seen"), "teacher": meta.get("teacher"),
              "checkpoint": str(ckpt)}
    return write_hf_folder(weights, config, output, tokenizer=tokenizer,
                           record={k: v for k, v in record.items() if v is not None},
                           source=f"checkpoint {ckpt}", overwrite=overwrite, inputs=inputs)


def run_tokenizer(ckpt: Path):
    """The tokenizer the stage puts into its own final folder (the initial student's, else the
    teacher's), read through the checkpoint's config; None for a random teacher or one that no
    longer loads here."""
    from ..config import ConfigError, load_resolved
    from ..stages import teacher_tokenizer

    try:
        cfg = load_resolved(ckpt / "config.yaml")
    except (ConfigError, OSError, ValueError):
        return None
    return teacher_tokenizer(cfg)


def cmd_export(args) -> int:
    out = export_checkpoint(args.checkpoint, args.output, overwrite=args.overwrite)
    print(f"exported {args.checkpoint} -> {out}")
    if (out / "config.json").exists() and not (out / "tokenizer_config.json").exists():
        print(f"note: {out} holds no tokenizer (the run's teacher has none, or it does not load "
              "here): NIAH and lm-eval need one in the model folder", flush=True)
    return 0


def register_export_command(sub) -> None:
    """Add `export` to the `halo-dist` parser."""
    import argparse

    from ..outputs import add_overwrite_flag

    e = sub.add_parser("export",
                       help="consolidate a training checkpoint (ZeRO shards) into an HF folder",
                       epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("--checkpoint", required=True,
                   help="a step-N folder, or a checkpoints folder (the newest that verifies)")
    e.add_argument("--output", required=True,
                   help="output folder (HF HypeNet) or folder for rnn_layers.safetensors")
    add_overwrite_flag(e)
    e.set_defaults(func=cmd_export)
