"""What every stage launcher does: parse the run config, check it is this launcher's stage, run.

User mistakes (config errors, missing files, data errors) end with one ``error:`` line and exit 2.
"""

from __future__ import annotations

import sys
from typing import Callable


def launch(stage: str, doc: str | None = None, argv: list[str] | None = None, *, trainer_cls: type | None = None,
           extra_args: Callable | None = None, on_check: Callable | None = None) -> int:
    """``trainer_cls``: a Trainer subclass for this stage; ``extra_args(parser)`` adds launcher flags;
    ``on_check(cfg, args)`` runs instead of training when the launcher's ``--check`` flag is given."""
    from .config import ConfigError, parse_run_args
    from .data import DataError
    from .models.convert import ConversionError
    from .train.checkpoint import CheckpointWriteError
    from .train.engine import NonFiniteLossError, StopRequested, run_stage

    argv = sys.argv[1:] if argv is None else list(argv)
    cfg, args = parse_run_args(argv, description=doc, prog=f"launchers/{stage}.py", extra_args=extra_args)
    if cfg.stage.name != stage:
        print(f"error: this is the {stage} launcher but the config says stage.name={cfg.stage.name}", file=sys.stderr)
        return 2
    try:
        if on_check is not None and getattr(args, "check", False):
            on_check(cfg, args)
            return 0
        run_stage(cfg, argv=[f"launchers/{stage}.py", *argv], trainer_cls=trainer_cls)
    except StopRequested as e:
        print(str(e), file=sys.stderr)
        return 0
    except (CheckpointWriteError, ConfigError, DataError, ConversionError, FileNotFoundError, NonFiniteLossError,
            ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
