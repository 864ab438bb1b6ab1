"""The golden comparison of the sequence-parallel mixer tests: token ``Layout``s (``CAUSAL``,
``PACKED``), the mixer / model forwards, ``golden`` (SP vs single-process outputs and gradients) and
the SP injectors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from halo_dist.models.hypenet.layers_hypenet import SequenceInfo
from halo_dist.parallel import SequenceParallel, apply_sequence_parallel, remove_sequence_parallel
from sp_testing import shard_seq

F64 = torch.float64


# --- token layouts ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """``docs=None``: one sequence per row; else the document lengths of each row (packed)."""

    batch: int = 2
    seq_len: int = 16
    docs: tuple[tuple[int, ...], ...] | None = None

    def tensors(self):
        """position_ids ``[B, T]`` (restarting per document), cu_seqlens over B*T (or None),
        max_seqlen."""
        if self.docs is None:
            return torch.arange(self.seq_len).expand(self.batch, -1), None, None
        lengths = [n for row in self.docs for n in row]
        assert len(self.docs) == self.batch and all(sum(r) == self.seq_len for r in self.docs)
        pos = torch.cat([torch.arange(n) for n in lengths]).view(self.batch, self.seq_len)
        cu = torch.cumsum(torch.tensor([0, *lengths]), 0).to(torch.int32)
        return pos, cu, max(lengths)


CAUSAL = Layout()
# sp=2 shards at token 8: row 0's 9-token document [3, 12) and row 1's [6, 16) start on rank 0 and
# end on rank 1; with sp=4 (shards of 4) the first one spans ranks 0, 1 and 2.
PACKED = Layout(docs=((3, 9, 4), (6, 10)))


# --- forwards -------------------------------------------------------------------------------------

def mixer_forward(mixer, x, pos, cu, max_seqlen):
    return mixer(x, SequenceInfo(position_ids=pos, cu_seqlens=cu, max_seqlen=max_seqlen))


def model_forward(model, x, pos, cu, max_seqlen):
    return model(inputs_embeds=x, position_ids=pos, cu_seqlens=cu, max_seqlen=max_seqlen).logits


# --- the golden comparison ------------------------------------------------------------------------

def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _reference(module, forward, x, w, pos, cu, max_seqlen):
    """Single-process forward / backward on the full sequence: (output, input grad, param grads)."""
    x = x.clone().requires_grad_()
    out = forward(module, x, pos, cu, max_seqlen)
    (out * w).sum().backward()
    # not embed_tokens
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def golden(sp: SequenceParallel, module, forward, layout: Layout, seed: int, inject) -> dict:
    """Max |SP - single-process| of the output, the input grad and the (SP-summed) parameter
    grads."""
    pos, cu, max_seqlen = layout.tensors()
    gen = torch.Generator().manual_seed(seed)  # the same full tensors on every rank
    x = torch.randn(layout.batch, layout.seq_len, _in_dim(module), generator=gen, dtype=F64)
    w = torch.randn(layout.batch, layout.seq_len, _out_dim(module), generator=gen, dtype=F64)
    out_ref, grad_x_ref, grads_ref = _reference(module, forward, x, w, pos, cu, max_seqlen)

    inject(module, sp)
    x_local = shard_seq(sp, x).clone().requires_grad_()  # [B, T/sp, d]: this rank's tokens
    out = forward(module, x_local, shard_seq(sp, pos), cu, max_seqlen)  # global positions' slice
    (out * shard_seq(sp, w)).sum().backward()  # the ranks' losses sum to the reference loss
    inject(module, None)
    res = {"out": _max_err(sp.gather_seq(out.detach(), dim=1), out_ref),
           "grad_x": _max_err(sp.gather_seq(x_local.grad, dim=1), grad_x_ref),
           "grad_params": 0.0, "worst_param": ""}
    params = dict(module.named_parameters())
    # embed_tokens (inputs_embeds)
    assert all(params[n].grad is None for n in params if n not in grads_ref)
    # one all-reduce, not one per parameter
    flat = torch.cat([params[n].grad.flatten() for n in grads_ref])
    dist.all_reduce(flat, group=sp.group)  # each rank's grads hold only its own tokens' share
    for name, g in zip(grads_ref, flat.split([grads_ref[n].numel() for n in grads_ref])):
        err = _max_err(g.view_as(grads_ref[name]), grads_ref[name])
        if err >= res["grad_params"]:
            res["grad_params"], res["worst_param"] = err, name
    res["n_params"] = len(grads_ref)
    # not a vacuous 0 == 0
    res["grad_scale"] = max(g.abs().max().item() for g in grads_ref.values())
    module.zero_grad(set_to_none=True)
    return res


def _in_dim(module) -> int:
    return module.config.hidden_size


def _out_dim(module) -> int:
    return module.config.vocab_size if hasattr(module, "lm_head") else module.config.hidden_size


def set_mixer_sp(mixer, sp):
    mixer.apply_sp(sp)


def apply_sp_to_model(model, sp):
    if sp is None:
        remove_sequence_parallel(model)
    else:
        apply_sequence_parallel(model, sp)
