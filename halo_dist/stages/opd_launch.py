"""What ``launchers/opd.py`` does (the style of ``halo_dist.launch``): parse, check the stage, run.

User mistakes (config errors, bad prompt sets, tokenizer/vocabulary mismatches, missing files) end
with one ``error:`` line and exit 2.
"""

from __future__ import annotations

import sys


def launch_opd(doc: str | None = None, argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from ..config import parse_run_args
    from ..models.convert import ConversionError
    from ..train.opd_loop import NonFiniteLossError, run_opd
    from .opd_prompts import PromptError

    argv = sys.argv[1:] if argv is None else argv
    cfg, _ = parse_run_args(argv, description=doc, prog="launchers/opd.py")
    if cfg.stage.name != "opd":
        print(f"error: this is the opd launcher but the config says stage.name={cfg.stage.name}", file=sys.stderr)
        return 2
    try:
        run_opd(cfg, argv=["launchers/opd.py", *argv])
    except (PromptError, ConversionError, FileNotFoundError, NonFiniteLossError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
