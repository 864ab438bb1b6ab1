"""Ulysses sequence parallelism inside the mixers, as one code path with and without it.

Every mixer runs the same forward: project the local tokens, ``sp_enter`` (the layout of the full
sequence), ``sp_scatter`` q/k/v and any per-token gates (``[B, T/sp, H, *] -> [B, T, H/sp, *]``),
its kernel over all tokens of its local heads, ``sp_gather`` the output
(``[B, T, H/sp, D] -> [B, T/sp, H, D]``), then its output norm / gate / W_o on the local tokens.
Without sequence parallelism (``sp`` None) every one of these steps is the identity. Heads are
independent in every mixer, so head-parallel over the full sequence computes exactly what one
process computes.

``mixer.apply_sp(sp)`` is the one entry point: the training engine (halo_dist/parallel/apply.py)
passes an object with ``world_size``, ``rank``, ``seq_to_head(x)``
``[B, T/sp, H, *] -> [B, T, H/sp, *]`` and ``head_to_seq(x)`` (its inverse); None (or size 1)
removes it. This file never imports the training code: it is exported with every checkpoint.
"""

from __future__ import annotations

import torch


class SequenceParallelMixer:
    """Mixin of every mixer (an ``nn.Module`` with ``num_heads``, ``num_kv_heads``,
    ``layer_idx``)."""

    sp = None  # the injected SP context; None: single process

    def apply_sp(self, sp) -> None:
        """Run this mixer head-parallel over ``sp``'s ranks (None, or a group of one: not at
        all)."""
        if sp is not None and sp.world_size > 1:
            self.check_sp_heads(sp.world_size)
        else:
            sp = None
        self.sp = sp

    def check_sp_heads(self, sp_size: int) -> None:
        """Ulysses gives each rank ``H/sp`` whole heads: ``sp`` must divide the query heads."""
        if self.num_heads % sp_size:
            raise ValueError(f"sp_size={sp_size} does not divide "
                             f"num_attention_heads={self.num_heads} of "
                             f"layer {self.layer_idx} ({type(self).__name__})")

    def sp_enter(self, info, cache=None):
        """The ``SequenceInfo`` the kernel sees: ``info`` itself, or under SP the full sequence's
        layout (:meth:`SequenceInfo.full_sequence`). Checks the heads before any communication; SP
        has no decoding cache (each rank would hold a slice of the prompt), so one passed here is
        refused."""
        if self.sp is None:
            return info
        self.check_sp_heads(self.sp.world_size)
        if cache is not None:
            raise ValueError("sequence parallelism has no decoding cache: remove it from the model "
                             "(apply_sp(None)) before generating")
        return info.full_sequence()

    def sp_scatter(self, *tensors: torch.Tensor, packed: bool = False) -> list[torch.Tensor]:
        """``[B, T/sp, H_i, *rest] -> [B, T, H_i/sp, *rest]`` each (identity without SP).
        ``packed``: one all-to-all per dtype for tensors sharing the head count (the gates travel
        with q/k/v)."""
        if self.sp is None:
            return list(tensors)
        if packed:
            return seq_to_head_packed(self.sp, list(tensors))
        return [self.sp.seq_to_head(t) for t in tensors]  # [B, T/sp, H_i, *] -> [B, T, H_i/sp, *]

    def sp_gather(self, o: torch.Tensor) -> torch.Tensor:
        """The kernel's output back to this rank's tokens:
        ``[B, T, H/sp, D] -> [B, T/sp, H, D]``."""
        # [B, T, H/sp, D] -> [B, T/sp, H, D]
        return o if self.sp is None else self.sp.head_to_seq(o)

    def sp_local_heads(self, per_head: torch.Tensor) -> torch.Tensor:
        """The entries ``[H, ...] -> [H/sp, ...]`` of the heads this rank holds after
        :meth:`sp_scatter` (global heads ``[rank*H/sp, (rank+1)*H/sp)``), e.g. per-head decay
        rates."""
        if self.sp is None:
            return per_head
        h = self.num_heads // self.sp.world_size
        return per_head[self.sp.rank * h : (self.sp.rank + 1) * h]

    def sp_replicate_kv(self, k: torch.Tensor,
                        v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """GQA under SP: repeat each KV head f times in place (:func:`kv_expand_factor`) so that
        every rank's KV heads after the all-to-all are those its query heads read.
        ``[B, T/sp, Hkv, D] -> [B, T/sp, Hkv*f, D]``."""
        if self.sp is None:
            return k, v
        f = kv_expand_factor(self.num_heads, self.num_kv_heads, self.sp.world_size)
        if f == 1:
            return k, v
        return k.repeat_interleave(f, dim=2), v.repeat_interleave(f, dim=2)  # [B, T/sp, Hkv*f, D]


def kv_expand_factor(num_q_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """Smallest f dividing the GQA group size g with (num_kv_heads * f) % sp_size == 0.

    KV heads are replicated f times (``repeat_interleave``) so each SP rank holds the KV heads its
    local query heads use: expanded head e serves query heads with ``i // (g / f) == e``. (The
    training side validates with halo_dist.parallel.ulysses.kv_replication_factor; a test keeps the
    two equal.)
    """
    g = num_q_heads // num_kv_heads
    for f in range(1, g + 1):
        if g % f == 0 and (num_kv_heads * f) % sp_size == 0:
            return f
    raise ValueError(
        f"sequence parallel size {sp_size} cannot split {num_q_heads} query heads / {num_kv_heads} "
        "KV heads"
    )


def seq_to_head_packed(sp, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """All-to-all several ``[B, T/sp, H, *rest]`` tensors with one collective per dtype.

    Same-dtype tensors are concatenated on a flattened last dim ``[B, T/sp, H, sum(rest)]``,
    exchanged to ``[B, T, H/sp, sum(rest)]`` and split back into ``[B, T, H/sp, *rest]``."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        # [B, T/sp, H, n_i]
        flat = [tensors[i].flatten(3) if tensors[i].dim() > 3 else tensors[i][..., None]
                for i in idx]
        moved = sp.seq_to_head(torch.cat(flat, dim=-1))  # [B, T/sp, H, n] -> [B, T, H/sp, n]
        for i, part in zip(idx, moved.split([f.shape[-1] for f in flat], dim=-1)):
            rest = tensors[i].shape[3:]
            # [B, T, H/sp, n_i] -> [B, T, H/sp, *rest]
            out[i] = part.reshape(*part.shape[:3], *rest)
    return out
