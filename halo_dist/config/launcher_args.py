"""Command-line front end shared by every launcher: ``--config FILE [key=value ...] [--dry-run]``.

Launchers stay thin: ``cfg, args = parse_run_args()`` and then build and run. Config
errors end the process with argparse's usage message and exit status 2, not a traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional, Sequence

from .coerce import ConfigError
from .loader import load_config
from .resolved import describe
from .schema import RunConfig


def add_config_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--config``, ``--dry-run``, ``--world-size`` and the ``key=value`` overrides."""
    parser.add_argument("--config", required=True, help="YAML run config (may use base: files)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="override a config key, e.g. optim.lr=5e-5 model.attn_layers=2,3,6")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved config and derived layout, then exit")
    parser.add_argument("--world-size", type=int, default=None,
                        help="with --dry-run: check the batch layout for this many ranks")
    # The deepspeed launcher appends --local_rank=N; torchrun sets LOCAL_RANK instead.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1,
                        help=argparse.SUPPRESS)
    return parser


def parse_run_args(argv: Optional[Sequence[str]] = None, description: Optional[str] = None,
                   prog: Optional[str] = None,
                   extra_args: Optional[Callable[[argparse.ArgumentParser], None]] = None,
                   ) -> tuple[RunConfig, argparse.Namespace]:
    """Parse the command line into a validated :class:`RunConfig`; handles ``--dry-run``.

    ``extra_args(parser)`` may add launcher-specific flags (e.g. pretrain's ``--check``).
    """
    parser = add_config_args(argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter))
    if extra_args is not None:
        extra_args(parser)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.dry_run:
            world = args.world_size or _env_world_size()
            sys.stdout.write(describe(cfg, world))
            raise SystemExit(0)
    except ConfigError as err:
        parser.error(str(err))
    return cfg, args


def _env_world_size() -> Optional[int]:
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value and value.isdigit() else None


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m halo_dist.config --config FILE [overrides]``: print the resolved config."""
    parse_run_args([*(sys.argv[1:] if argv is None else argv), "--dry-run"],
                   description="Print a resolved halo_dist run config.",
                   prog="python -m halo_dist.config")
