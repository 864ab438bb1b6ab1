"""The FlexAttention document mask built from cu_seqlens equals create_block_mask's (which needs a
dense [T, T] grid: 64 GiB at 256K tokens, the OOM that capped stage-3 context at SP = 2)."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from halo_dist.models.hypenet.ops_attention import document_block_mask, segment_ids_from_cu_seqlens


def _boundaries(B, T, n_cuts, seed):
    g = torch.Generator().manual_seed(seed)
    cuts = set(torch.randint(1, B * T, (n_cuts,), generator=g).tolist()) | set(range(T, B * T, T))
    return torch.tensor([0, *sorted(cuts), B * T], dtype=torch.int32)  # row ends are document ends


@pytest.mark.parametrize("B,T,window,block,n_cuts", [
    (1, 512, None, 128, 2),    # long documents: many full blocks
    (2, 300, None, 64, 6),     # T not a multiple of the block
    (2, 384, 100, 64, 3),      # sliding window
    (1, 1000, 129, 128, 1),
    (3, 256, 1, 32, 8),        # window of one key
    (1, 640, None, 64, 0),     # one document: plain causal
])
def test_document_block_mask_equals_create_block_mask(B, T, window, block, n_cuts):
    cu = _boundaries(B, T, n_cuts, seed=T + B)
    seg = segment_ids_from_cu_seqlens(cu, B * T).view(B, T)

    def doc_causal(b, h, q, k):
        keep = (q >= k) & (seg[b, q] == seg[b, k])
        return keep & (q - k < window) if window is not None else keep

    ref = create_block_mask(doc_causal, B, None, T, T, device="cpu", BLOCK_SIZE=block)
    ours = document_block_mask(cu, B, T, window, block_size=block)
    assert torch.equal(ours.kv_num_blocks, ref.kv_num_blocks)
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)
    assert torch.equal(ours.to_dense(), ref.to_dense())
    if n_cuts <= 2 and window is None:
        assert ours.full_kv_num_blocks.sum() > 0  # the case exercises full blocks
    q, k, v = torch.randn(3, B, 2, T, 16).unbind(0)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=ours),
                               flex_attention(q, k, v, block_mask=ref), rtol=0, atol=0)


def test_document_block_mask_memory_is_per_block_not_per_token():
    """256K tokens: the dense grid would hold 2^36 booleans; the block mask holds 2048^2 small
    entries."""
    T = 262_144
    cu = torch.tensor([0, 70_000, 200_000, T], dtype=torch.int32)
    mask = document_block_mask(cu, 1, T, None)
    assert mask.kv_indices.numel() == (T // 128) ** 2
    # documents [0, 70000) [70000, 200000) [200000, T): query block 1000 (tokens 128000..128127)
    # sees blocks 546 (token 69888, holding 70000) .. 1000; 547..999 are full
    assert mask.kv_num_blocks[0, 0, 1000] + mask.full_kv_num_blocks[0, 0, 1000] == 1000 - 546 + 1
    assert mask.full_kv_num_blocks[0, 0, 1000] == 999 - 547 + 1
