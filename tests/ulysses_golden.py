"""The Ulysses golden comparison: ``attention`` (single-process causal GQA attention),
``sp_attention`` (its Ulysses form), ``max_err`` and ``attention_golden`` (Ulysses vs full
attention, outputs and input gradients)."""

from __future__ import annotations

import math

import torch

from halo_dist.parallel import SequenceParallel
from sp_testing import kv_seq_to_head, shard_seq

F64 = torch.float64


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention with GQA: q [B,T,H,D], k/v [B,T,Hkv,D] -> [B,T,H,D];
    query head i uses KV head i // (H/Hkv)."""
    h, t = q.shape[2], q.shape[1]
    k = k.repeat_interleave(h // k.shape[2], dim=2)  # [B, T, Hkv, D] -> [B, T, H, D]
    v = v.repeat_interleave(h // v.shape[2], dim=2)  # [B, T, Hkv, D] -> [B, T, H, D]
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    causal = torch.ones(t, t, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    return torch.einsum("bhts,bshd->bthd", probs, v)


def sp_attention(sp: SequenceParallel, q, k, v) -> torch.Tensor:
    """Ulysses attention: local q [B,T/sp,H,D], k/v [B,T/sp,Hkv,D] -> [B,T/sp,H,D]."""
    num_heads = q.shape[2]
    q = sp.seq_to_head(q)  # [B, T, H/sp, D]
    k = kv_seq_to_head(sp, k, num_heads)  # [B, T, lcm(Hkv,sp)/sp, D]
    v = kv_seq_to_head(sp, v, num_heads)
    return sp.head_to_seq(attention(q, k, v))  # [B, T, H/sp, D] -> [B, T/sp, H, D]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def attention_golden(sp: SequenceParallel, num_heads: int, num_kv_heads: int, seed: int,
                     batch: int = 2, seq_len: int = 8, head_dim: int = 4) -> dict[str, float]:
    """Max |error| of Ulysses vs full attention: output and input gradients (q, k, v)."""
    gen = torch.Generator().manual_seed(seed)  # same full tensors on every rank of the SP group
    shapes = [(batch, seq_len, h, head_dim) for h in (num_heads, num_kv_heads, num_kv_heads,
                                                      num_heads)]
    q, k, v, w = (torch.randn(s, generator=gen, dtype=F64) for s in shapes)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = attention(*full)
    (ref * w).sum().backward()
    local = [shard_seq(sp, x).clone().requires_grad_() for x in (q, k, v)]
    out = sp_attention(sp, *local)
    (out * shard_seq(sp, w)).sum().backward()  # rank losses sum to the reference loss
    errors = {"out": max_err(out, shard_seq(sp, ref))}
    for name, f, loc in zip("qkv", full, local):
        errors[f"grad_{name}"] = max_err(loc.grad, shard_seq(sp, f.grad))
    return errors
