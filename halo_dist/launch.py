"""What every stage launcher does: parse the run config, check it is this launcher's stage, run.

User mistakes (config errors, missing files, data errors) end with one ``error:`` line and exit 2.
"""

from __future__ import annotations

import sys


def launch(stage: str, doc: str | None = None, argv: list[str] | None = None) -> int:
    from .config import parse_run_args
    from .data import DataError
    from .models.convert import ConversionError
    from .train.engine import NonFiniteLossError, StopRequested, run_stage

    argv = sys.argv[1:] if argv is None else argv
    cfg, _ = parse_run_args(argv, description=doc, prog=f"launchers/{stage}.py")
    if cfg.stage.name != stage:
        print(f"error: this is the {stage} launcher but the config says stage.name={cfg.stage.name}", file=sys.stderr)
        return 2
    try:
        run_stage(cfg, argv=[f"launchers/{stage}.py", *argv])
    except StopRequested as e:
        print(str(e), file=sys.stderr)
        return 0
    except (DataError, ConversionError, FileNotFoundError, NonFiniteLossError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
