"""Test-side helpers around ``SequenceParallel``: cut a full-sequence reference into this rank's
share, as the data loader does for real runs, so golden tests can compare a rank's output with the
single-process result."""

from __future__ import annotations

import torch

from halo_dist.parallel.ulysses import SequenceParallel, replicate_kv_heads


def seq_slice(sp: SequenceParallel, seq_len: int) -> slice:
    """Global token indices this rank holds of a full sequence of ``seq_len`` tokens."""
    if seq_len % sp.world_size:
        raise ValueError(f"sequence length T={seq_len} is not divisible by sp={sp.world_size}")
    n = seq_len // sp.world_size
    return slice(sp.rank * n, (sp.rank + 1) * n)


def head_slice(sp: SequenceParallel, num_heads: int) -> slice:
    """Global head indices this rank holds after ``seq_to_head``."""
    n = sp.local_heads(num_heads)
    return slice(sp.rank * n, (sp.rank + 1) * n)


def shard_seq(sp: SequenceParallel, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous block of a full-sequence tensor: ``[.., T, ..] -> [.., T/sp, ..]``."""
    if not sp.enabled:
        return x
    s = seq_slice(sp, x.shape[dim])
    return x.narrow(dim, s.start, s.stop - s.start)


def kv_seq_to_head(sp: SequenceParallel, kv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """GQA keys/values ``[B, T/sp, Hkv, D] -> [B, T, lcm(Hkv, sp)/sp, D]``: KV heads replicated
    first when sp does not divide Hkv, then exchanged like q."""
    return sp.seq_to_head(replicate_kv_heads(kv, num_heads, sp.world_size))
