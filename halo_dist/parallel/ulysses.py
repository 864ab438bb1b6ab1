"""Ulysses sequence parallelism: differentiable all-to-alls between sequence and head sharding.

Each rank of an SP group of size ``sp`` holds a *contiguous* block of ``T/sp`` tokens: rank ``r``
owns tokens ``[r*T/sp, (r+1)*T/sp)``. ``seq_to_head`` swaps that for all ``T`` tokens of a block
of ``H/sp`` heads (rank ``r`` owns heads ``[r*H/sp, (r+1)*H/sp)``), the mixer runs its full-sequence
kernel on those heads -- exact for softmax attention and for Lightning/linear-attention recurrences
because heads are independent -- and ``head_to_seq`` swaps back (Ulysses, Jacobs et al. 2023).
Both are ``all_to_all_single`` permutations; each one's backward is the other.

All tensors are ``[B, T, H, *rest]`` (``rest`` usually ``[D]``). All SP ranks must pass equal
shapes; ``SequenceParallel(validate_shapes=True)`` checks that with one small all-gather per call.

KV-head replication rule (GQA with ``H`` query heads, ``Hkv`` KV heads, query head ``i`` using KV
head ``i // (H/Hkv)``): when ``sp`` does not divide ``Hkv`` (e.g. ``Hkv < sp``), each KV head is
repeated ``f = sp / gcd(Hkv, sp)`` times *in place* (``repeat_interleave`` on the head dim), giving
``Hkv' = lcm(Hkv, sp)`` heads where new head ``j`` is a copy of old head ``j // f``. Query head
``i`` then uses new head ``i // (H/Hkv')``, a copy of old head ``i // (H/Hkv)`` -- the same head --
so after ``seq_to_head`` each rank's ``H/sp`` query heads find their KV heads among its own
``Hkv'/sp`` heads with the usual local rule ``local_q // (H/Hkv')``. ``H % sp == 0`` is required
(then ``H`` is a multiple of ``lcm(Hkv, sp)``); gradients of the copies are summed by autograd.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import HaloUserError


class SequenceParallelError(HaloUserError, ValueError):
    """Shapes that cannot be split across the sequence-parallel ranks."""


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _check_divisible(n: int, sp: int, what: str) -> None:
    if n % sp:
        raise SequenceParallelError(f"{what}={n} is not divisible by the sequence-parallel size "
                                    f"sp={sp}")


def _check_ndim(x: torch.Tensor, fn: str) -> None:
    if x.dim() < 3:
        raise SequenceParallelError(f"{fn} expects [B, T, H, ...], got shape {tuple(x.shape)}")


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    """``x[j]`` goes to SP rank ``j``; ``out[j]`` is what rank ``j`` sent here. x: [sp, ...]."""
    x = x.contiguous()
    out = torch.empty_like(x)  # after contiguous(): empty_like keeps a permuted input's strides
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    sp = dist.get_world_size(group)
    b, t_local, h, *rest = x.shape
    _check_divisible(h, sp, "number of heads H")
    x = x.reshape(b, t_local, sp, h // sp, -1)  # [B, T/sp, H, D] -> [B, T/sp, sp, H/sp, D]
    x = x.permute(2, 0, 1, 3, 4)  # -> [sp, B, T/sp, H/sp, D]: chunk j = heads of rank j
    y = _exchange(x, group)  # [sp, B, T/sp, H/sp, D]: chunk j = tokens of rank j
    y = y.permute(1, 0, 2, 3, 4)  # -> [B, sp, T/sp, H/sp, D]
    return y.reshape(b, sp * t_local, h // sp, *rest)  # -> [B, T, H/sp, D]


def _head_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    sp = dist.get_world_size(group)
    b, t, h_local, *rest = x.shape
    _check_divisible(t, sp, "sequence length T")
    x = x.reshape(b, sp, t // sp, h_local, -1)  # [B, T, H/sp, D] -> [B, sp, T/sp, H/sp, D]
    x = x.permute(1, 0, 2, 3, 4)  # -> [sp, B, T/sp, H/sp, D]: chunk j = tokens of rank j
    y = _exchange(x, group)  # [sp, B, T/sp, H/sp, D]: chunk j = heads of rank j
    y = y.permute(1, 2, 0, 3, 4)  # -> [B, T/sp, sp, H/sp, D]
    return y.reshape(b, t // sp, sp * h_local, *rest)  # -> [B, T/sp, H, D]


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad, ctx.group), None  # adjoint of a permutation is its inverse


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _head_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad, ctx.group), None


def seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    """``[B, T/sp, H, *rest] -> [B, T, H/sp, *rest]`` over ``group`` (differentiable).

    Output tokens are in global order (rank r's block at ``[r*T/sp, (r+1)*T/sp)``); local heads
    are global heads ``[rank*H/sp, (rank+1)*H/sp)``. Raises if ``H % sp != 0``.
    """
    _check_ndim(x, "seq_to_head")
    if _group_size(group) == 1:
        return x
    _check_divisible(x.shape[2], _group_size(group), "number of heads H")
    return _SeqToHead.apply(x, group)


def head_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """``[B, T, H/sp, *rest] -> [B, T/sp, H, *rest]`` over ``group`` (differentiable inverse of
    :func:`seq_to_head`). Raises if ``T % sp != 0``."""
    _check_ndim(x, "head_to_seq")
    if _group_size(group) == 1:
        return x
    _check_divisible(x.shape[1], _group_size(group), "sequence length T")
    return _HeadToSeq.apply(x, group)


def kv_replication_factor(num_heads: int, num_kv_heads: int, sp: int) -> int:
    """How many times to repeat each KV head so that ``sp`` divides the KV heads (see module doc).

    Returns ``sp / gcd(num_kv_heads, sp)`` (1 when ``sp`` already divides ``num_kv_heads``).
    """
    if num_heads % sp:
        raise SequenceParallelError(f"number of heads H={num_heads} is not divisible by the "
                                    f"sequence-parallel size sp={sp}; choose sp dividing H")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise SequenceParallelError(f"H={num_heads} query heads is not a multiple of "
                                    f"{num_kv_heads} KV heads")
    return sp // math.gcd(num_kv_heads, sp)


def replicate_kv_heads(kv: torch.Tensor, num_heads: int, sp: int) -> torch.Tensor:
    """``[B, T, Hkv, *rest] -> [B, T, lcm(Hkv, sp), *rest]`` by repeating each KV head in place.

    Keeps the GQA mapping (query head i -> KV head i // (H/Hkv)); identity when sp | Hkv.
    """
    factor = kv_replication_factor(num_heads, kv.shape[2], sp)
    return kv if factor == 1 else kv.repeat_interleave(factor, dim=2)  # [B, T, Hkv*f, D]


# torch >= 2.12 renamed the tensor collectives (the old names warn); torch 2.11 has only the old
# ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherSeq(torch.autograd.Function):
    """All-gather along ``dim``; backward reduce-scatters (``sum``) or slices (``slice``)."""

    @staticmethod
    def forward(ctx, x, group, dim, grad_mode):
        ctx.group, ctx.dim, ctx.grad_mode = group, dim, grad_mode
        x = x.movedim(dim, 0).contiguous()  # [.., T/sp, ..] -> [T/sp, ..]
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))  # [T, ..]
        _all_gather_single(out, x, group=group)  # rank r's block lands at [r*T/sp, (r+1)*T/sp)
        return out.movedim(0, dim)  # [T, ..] -> [.., T, ..]

    @staticmethod
    def backward(ctx, grad):
        sp, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        grad = grad.movedim(ctx.dim, 0).contiguous()  # [.., T, ..] -> [T, ..]
        local = grad.shape[0] // sp
        if ctx.grad_mode == "sum":
            out = grad.new_empty((local, *grad.shape[1:]))  # [T/sp, ..]
            _reduce_scatter_single(out, grad, group=ctx.group)
        else:
            out = grad[rank * local:(rank + 1) * local]  # [T/sp, ..]
        return out.movedim(0, ctx.dim).contiguous(), None, None, None  # -> [.., T/sp, ..]


class SequenceParallel:
    """The SP context a mixer receives (``mixer.apply_sp(SequenceParallel(group))``).

    ``group=None`` means *no* sequence parallelism (size 1; every method is the identity), not
    the world group. Token layout: rank ``r`` holds the contiguous tokens
    ``[r*T/sp, (r+1)*T/sp)`` of each sequence; after :meth:`seq_to_head` it holds all tokens of
    heads ``[r*H/sp, (r+1)*H/sp)``. All SP ranks must pass equal shapes; ``validate_shapes=True``
    verifies it (one small all-gather per call) and raises the same clear error on every rank.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, validate_shapes: bool = False):
        self.group = group
        self.world_size = _group_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if self.rank < 0:
            raise ValueError(f"rank {dist.get_rank()} is not a member of the sequence-parallel "
                             "group it was given")
        self.validate_shapes = validate_shapes

    def __repr__(self):
        return f"SequenceParallel(world_size={self.world_size}, rank={self.rank})"

    @property
    def enabled(self) -> bool:
        """True when the sequence is split over more than one rank."""
        return self.world_size > 1

    def _validate(self, x: torch.Tensor, what: str) -> None:
        if not (self.validate_shapes and self.enabled):
            return
        mine = torch.full((8,), -1, dtype=torch.long, device=x.device)  # NCCL needs device tensors
        mine[: min(x.dim(), 8)] = torch.tensor(x.shape[:8], dtype=torch.long)
        shapes = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(shapes, mine, group=self.group)
        if any(not torch.equal(s, shapes[0]) for s in shapes):
            seen = [tuple(int(v) for v in s if v >= 0) for s in shapes]
            raise SequenceParallelError(f"{what}: SP ranks hold different shapes {seen}; every "
                                        "rank must hold T/sp tokens (pad the sequence to a "
                                        f"multiple of sp={self.world_size})")

    def local_heads(self, num_heads: int) -> int:
        """Heads per rank after :meth:`seq_to_head` (``H/sp``); raises if ``sp`` does not divide
        H."""
        _check_divisible(num_heads, self.world_size, "number of heads H")
        return num_heads // self.world_size

    def seq_to_head(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T/sp, H, *rest] -> [B, T, H/sp, *rest]``; backward is :meth:`head_to_seq`."""
        self._validate(x, "seq_to_head")
        return seq_to_head(x, self.group)

    def head_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, H/sp, *rest] -> [B, T/sp, H, *rest]``; backward is :meth:`seq_to_head`."""
        self._validate(x, "head_to_seq")
        return head_to_seq(x, self.group)

    def gather_seq(self, x: torch.Tensor, dim: int = 1, grad: str = "sum") -> torch.Tensor:
        """All-gather the sequence dim: ``[.., T/sp, ..] -> [.., T, ..]`` in global token order.

        ``grad="sum"`` (default): backward sums the output gradients of all SP ranks and returns
        this rank's block (reduce-scatter) -- right when each rank computes a *different* part of
        the loss from the gathered tensor. ``grad="slice"``: backward returns this rank's block of
        its own output gradient -- right when every rank computes the *same* thing from it and the
        loss is counted once per SP group.
        """
        if grad not in ("sum", "slice"):
            raise ValueError(f"gather_seq grad must be 'sum' or 'slice', got {grad!r}")
        if not self.enabled:
            return x
        self._validate(x, "gather_seq")
        return _GatherSeq.apply(x, self.group, dim % x.dim(), grad)
