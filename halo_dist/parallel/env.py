"""This process's place in a distributed job: a plain ``python launcher.py`` becomes a 1-rank job,
and each rank takes its GPU."""

from __future__ import annotations

import os
import socket
from contextlib import closing

import torch

from ..errors import HaloUserError


def _free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What torchrun and the deepspeed launcher set for every rank. DeepSpeed needs all five: with one
# missing it falls back to MPI discovery, which fails without mpi4py (a traceback) or, with it,
# makes up a world of its own.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class LaunchEnvironmentError(HaloUserError, RuntimeError):
    """The environment names this process's place in a job, but not all of it."""


def ensure_distributed_env() -> None:
    """Let a plain ``python launchers/stageN.py`` run as a 1-rank job; ``RANK`` in the environment
    means a launcher started this process, and then the rest must be there too."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
        return
    missing = [name for name in LAUNCHER_VARIABLES if not os.environ.get(name)]
    if missing:
        raise LaunchEnvironmentError(
            f"RANK is set ({os.environ['RANK']}) but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not: start the job with torchrun (or the "
            "deepspeed launcher), which sets all of " + ", ".join(LAUNCHER_VARIABLES)
            + "; under srun without torchrun export them from SLURM_PROCID, SLURM_NTASKS, "
            "SLURM_LOCALID and the first node's address; or unset RANK for a one-process run")
    _check_ranks()


def _check_ranks() -> None:
    try:
        rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        port = int(os.environ["MASTER_PORT"])
    except ValueError:
        raise LaunchEnvironmentError(
            "RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT must be integers, got "
            + ", ".join(f"{k}={os.environ[k]!r}" for k in LAUNCHER_VARIABLES if k != "MASTER_ADDR")
        ) from None
    if not (0 <= rank < world and local >= 0 and 0 < port < 65536):
        raise LaunchEnvironmentError(f"RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK={local}, "
                                     f"MASTER_PORT={port}: need 0 <= RANK < WORLD_SIZE, "
                                     "LOCAL_RANK >= 0 and a port in 1..65535")


def local_device() -> torch.device:
    """This rank's GPU (``LOCAL_RANK``), made the current one; the CPU without GPUs."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    torch.cuda.set_device(device)
    return device
