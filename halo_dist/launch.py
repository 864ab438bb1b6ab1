"""What every stage launcher does: parse the run config, check it is this launcher's stage, run it
with the stage's row of ``halo_dist.registry``.

User mistakes (:class:`~halo_dist.errors.HaloUserError`: config errors, missing files, data errors,
...) end with one ``error:`` line and exit 2; a stop signal checkpoints and exits 0; anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from typing import Callable

from .errors import HaloUserError


def launch(stage: str, doc: str | None = None, argv: list[str] | None = None, *,
           extra_args: Callable | None = None, on_check: Callable | None = None) -> int:
    """``extra_args(parser)`` adds launcher flags; ``on_check(cfg, args)`` runs instead of training
    when the launcher's ``--check`` flag is given."""
    from .config import parse_run_args

    argv = sys.argv[1:] if argv is None else list(argv)
    cfg, args = parse_run_args(argv, description=doc, prog=f"launchers/{stage}.py",
                               extra_args=extra_args)
    # torch, transformers and the stages load only now (~5 s): a config mistake is reported at once
    from .train.entry import run_stage
    from .registry import stage_spec
    from .train.stopping import StopRequested

    try:
        spec = stage_spec(stage)
        if cfg.stage.name != stage:
            raise HaloUserError(f"this is the {stage} launcher but the config says "
                                f"stage.name={cfg.stage.name}")
        if on_check is not None and getattr(args, "check", False):
            on_check(cfg, args)
            return 0
        run_stage(cfg, spec, argv=[f"launchers/{stage}.py", *argv])
    except StopRequested as e:
        print(str(e), file=sys.stderr)
        return 0
    except HaloUserError as e:
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)  # rank_failures.RankFailure: the failed rank's status
    return 0


def launch_pretrain(doc: str | None = None, argv: list[str] | None = None) -> int:
    """``launchers/pretrain.py``: parse, [--check: print the plan, exit], run."""
    from .stages.pretrain import check_flag, print_check

    return launch("pretrain", doc, argv, extra_args=check_flag, on_check=print_check)


def launch_opd(doc: str | None = None, argv: list[str] | None = None) -> int:
    """``launchers/opd.py``: :func:`launch` for stage opd, then the process group is torn down (the
    OPD trainer creates its own when none exists)."""
    try:
        return launch("opd", doc, argv)
    finally:
        dist = sys.modules.get("torch.distributed")  # not imported: no group to tear down
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()
