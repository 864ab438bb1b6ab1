"""Distillation losses: fused, chunked KL / CE over the full vocabulary (see ``kl.py``)."""

from halo_dist.losses._chunked import auto_chunk_size
from halo_dist.losses.kl import (
    DistillLossOutput,
    FusedDistillLoss,
    fused_distill_loss,
    naive_distill_loss,
)

__all__ = [
    "DistillLossOutput",
    "FusedDistillLoss",
    "auto_chunk_size",
    "fused_distill_loss",
    "naive_distill_loss",
]
