"""Gradient reductions of the plain (non-DeepSpeed) data-parallel path."""

from __future__ import annotations

import torch
import torch.distributed as dist


def allreduce_mean_grads(params: list, world: int) -> None:
    """Average gradients over the ranks (one flat fp32 all-reduce); a missing gradient counts as 0.

    With every micro-batch loss divided by ``N_global / world`` this makes the update the gradient
    of the global per-token mean (token-weighted DP reduction).
    """
    if world <= 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
        offset += n
