"""halo_dist.models.fla_offsets: fla's packed-batch state passes with the chunk count read once per
batch. CPU: the count, its cache and the registration; GPU: bitwise fla's results, fewer syncs."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from halo_dist.models import fla_offsets

fla = pytest.importorskip("fla")


class _CountReads(TorchDispatchMode):
    """Counts ``.item()``-style reads (a sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func._schema.name == "aten::_local_scalar_dense"
        return func(*args, **(kwargs or {}))


def test_the_chunk_count_is_read_once_per_tensor():
    cu = torch.tensor([0, 70, 71, 200], dtype=torch.int32)
    with _CountReads() as mode:
        counts = [fla_offsets.split_count(cu, 64) for _ in range(5)]
    assert counts == [2 + 1 + 3] * 5 and mode.reads == 1  # ceil(70/64) + 1 + ceil(129/64)
    assert fla_offsets.split_count(cu, 128) == 1 + 1 + 2  # another split size: its own entry
    same_values = cu.clone()
    with _CountReads() as mode:
        assert fla_offsets.split_count(same_values, 64) == 6
    assert mode.reads == 1  # another tensor object is another key


def test_install_registers_for_packed_batches_only_and_only_for_its_fla_version(monkeypatch):
    from fla.backends import _get_operation_registry

    assert fla_offsets.install()
    backend = _get_operation_registry("common")._backends["halo_cached_offsets"]
    assert backend.verify("chunk_fwd_h", k=None, cu_seqlens=torch.tensor([0, 4]))[0]
    assert not backend.verify("chunk_bwd_dh", q=None, cu_seqlens=None)[0]
    assert backend.get_implementation("chunk_fwd_o") is None  # other functions stay fla's
    monkeypatch.setenv(fla_offsets.ENV_VAR, "0")
    assert not backend.is_enabled()
    monkeypatch.setattr(fla_offsets, "_installed", False)
    monkeypatch.setattr(fla_offsets, "FLA_VERSION", "0.0.1")
    assert not fla_offsets.install()


@pytest.mark.cuda
def test_chunk_simple_gla_is_bitwise_fla_with_fewer_syncs(monkeypatch):
    """A packed batch through fla's chunk_simple_gla, forward and backward, with the replacements
    on and off: identical outputs, state and gradients; the syncs drop from one per state pass to
    one per batch."""
    from fla.ops.simple_gla import chunk_simple_gla

    assert fla_offsets.install()
    torch.manual_seed(0)
    T, H, D = 1000, 4, 128  # head size of the 2B model: its autotune results are cached
    cu = torch.tensor([0, 300, 301, 777, T], dtype=torch.int32, device="cuda")
    base = [torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    gamma = -torch.rand(H, device="cuda")

    def run(enabled: str):
        monkeypatch.setenv(fla_offsets.ENV_VAR, enabled)
        q, k, v = (x.clone().requires_grad_() for x in base)
        torch.cuda.synchronize()
        syncs = []
        torch.cuda.set_sync_debug_mode("warn")
        with pytest.warns(UserWarning) as record:
            for _ in range(3):  # three layers of one forward share cu_seqlens
                o, ht = chunk_simple_gla(q, k, v, g_gamma=gamma, scale=D**-0.5,
                                         output_final_state=True, cu_seqlens=cu)
                (o.float().square().sum() + ht.sum()).backward()
            syncs = [w for w in record if "synchronizing" in str(w.message)]
        torch.cuda.set_sync_debug_mode(0)
        return [o, ht, q.grad, k.grad, v.grad], len(syncs)

    ours, ours_syncs = run("1")
    fla_own, fla_syncs = run("0")
    assert all(torch.equal(a, b) for a, b in zip(ours, fla_own))
    # measured on the H200: 9 (three per layer) against 3 (none of them in the state passes)
    assert fla_syncs >= 9 and ours_syncs <= 3, (ours_syncs, fla_syncs)

