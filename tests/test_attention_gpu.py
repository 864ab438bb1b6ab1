"""The CUDA attention paths of ``ops_attention`` against their CPU path (explicit boolean masks,
k/v repeated), run in fp32 on the GPU: the packed document-masked attention (FlexAttention, with and
without a sliding window; forward and backward), the chunked prefill's lower-right causal bias and
decode's in-place GQA. Inputs are bf16, so each relative error sits near bf16's rounding (the H200
run of 2026-11-30: 0.0020-0.0025); 2**-7 leaves room for another card without hiding a wrong mask,
which is off by O(1)."""

import pytest
import torch
from conftest import rel_err

from halo_dist.models.hypenet import ops_attention as ops

pytestmark = pytest.mark.cuda
TOL = 2**-7
H, HKV, D = 16, 8, 128
SCALE = D**-0.5


def reference_packed(q, k, v, cu, window=None):
    """Explicit segment x causal (x window) mask over [B, T, H, D] rows packed by ``cu``."""
    B, T = q.shape[:2]
    seg = ops.segment_ids_from_cu_seqlens(cu, B * T).view(B, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if window is not None:
        causal &= ~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(-window)
    mask = ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]  # [B, 1, T, T]
    kk, vv = (t.repeat_interleave(q.shape[2] // t.shape[2], dim=2) for t in (k, v))
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), attn_mask=mask, scale=SCALE)
    return o.transpose(1, 2)  # [B, H, T, D] -> [B, T, H, D]


@pytest.mark.parametrize("window", [None, 512])
def test_packed_flex_attention_and_its_gradients_equal_the_explicit_mask(window):
    torch.manual_seed(0)
    B, T = 2, 4096
    # documents cross the row boundary at 4096 and one row ends mid-document
    cu = torch.tensor([0, 1000, 3000, 4096, 4096 + 2500, 8192], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(B, T, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (H, HKV, HKV))
    kw = {"window": window} if window else {}
    o = ops.packed_causal_attention(q, k, v, cu, T, SCALE, **kw)
    assert not ops._FLEX["failed"], "FlexAttention fell back to the explicit mask"
    g = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), g)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = reference_packed(q32, k32, v32, cu, window)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), g.float())
    errors = [rel_err(o, ref)] + [rel_err(a, b) for a, b in zip(grads, ref_grads)]
    assert max(errors) < TOL, errors


def test_chunk_prefill_uses_the_lower_right_causal_bias():
    """2,048 new queries over a 6,144-key cache: query i sees keys up to 4,096 + i."""
    torch.manual_seed(0)
    Tq, Tk = 2048, 6144
    q = torch.randn(1, Tq, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, Tk, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = torch.ones(Tq, Tk, dtype=torch.bool, device="cuda").tril(diagonal=Tk - Tq)[None, None]
    ref = ops.sdpa(q.float(), k.float(), v.float(), mask=mask, scale=SCALE)
    assert rel_err(ops.chunk_prefill_attention(q, k, v, SCALE), ref) < TOL


def test_decode_sdpa_groups_the_kv_heads_in_place():
    torch.manual_seed(0)
    q = torch.randn(1, 1, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 6144, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kk, vv = (t.float().repeat_interleave(H // HKV, dim=2) for t in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), scale=SCALE)
    assert rel_err(ops.sdpa(q, k, v, scale=SCALE), ref.transpose(1, 2)) < TOL
