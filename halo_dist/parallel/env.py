"""This process's place in a distributed job: a plain ``python launcher.py`` becomes a 1-rank job,
and each rank takes its GPU."""

from __future__ import annotations

import os
import socket
from contextlib import closing

import torch


def _free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_distributed_env() -> None:
    """Let a plain ``python launchers/stageN.py`` run as a 1-rank job (torchrun/deepspeed/srun set
    these)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))


def local_device() -> torch.device:
    """This rank's GPU (``LOCAL_RANK``), made the current one; the CPU without GPUs."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    torch.cuda.set_device(device)
    return device
