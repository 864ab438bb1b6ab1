"""What ``launchers/opd.py`` does: :func:`halo_dist.launch.launch` with the OPD trainer.

User mistakes (config errors, bad prompt sets, tokenizer/vocabulary mismatches, missing files) end
with one ``error:`` line and exit 2 (``PromptError`` and ``ConversionError`` are ``ValueError``s); a
stop signal checkpoints and exits 0.
"""

from __future__ import annotations


def launch_opd(doc: str | None = None, argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from ..launch import launch
    from ..train.opd_loop import OPDTrainer

    try:
        return launch("opd", doc, argv, trainer_cls=OPDTrainer)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
