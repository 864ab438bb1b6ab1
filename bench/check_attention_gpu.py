"""Device check: the CUDA attention paths of ops_attention against the reference (explicit-mask SDPA
in fp32).

* packed_causal_attention on CUDA (FlexAttention block-sparse document mask, GQA in place), with and
  without a sliding window, forward and backward;
* chunk_prefill_attention (SDPA lower-right causal bias) for a chunk over a longer cache;
* sdpa with ``enable_gqa`` (decode: one query over all cached keys).

The reference is the CPU path of the same functions (explicit boolean masks, k/v repeated), run in
fp32 on the GPU. Prints a table and writes ``bench/results/attention_gpu.json``.

  python bench/check_attention_gpu.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import no_options, print_table, rel_err, time_cuda, write_result  # noqa: E402
from halo_dist.models.hypenet import ops_attention as ops  # noqa: E402


def reference_packed(q, k, v, cu, scale, window=None):
    B, T = q.shape[:2]
    seg = ops.segment_ids_from_cu_seqlens(cu, B * T).view(B, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if window is not None:
        causal &= ~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(-window)
    mask = ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]
    kk = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    vv = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), attn_mask=mask, scale=scale)
    return o.transpose(1, 2)


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    B, T, H, Hkv, D = 2, 4096, 16, 8, 128
    scale = D**-0.5
    rows = []
    cu = torch.tensor([0, 1000, 3000, 4096, 4096 + 2500, 8192], dtype=torch.int32, device=dev)
    for window in (None, 512):
        q, k, v = (torch.randn(B, T, h, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
                   for h in (H, Hkv, Hkv))
        o = ops.packed_causal_attention(q, k, v, cu, T, scale, window=window) if window else \
            ops.packed_causal_attention(q, k, v, cu, T, scale)
        g = torch.randn_like(o)
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), g)
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
        ref = reference_packed(q32, k32, v32, cu, scale, window)
        rq, rk, rv = torch.autograd.grad(ref, (q32, k32, v32), g.float())
        ms = time_cuda(lambda: ops.packed_causal_attention(q, k, v, cu, T, scale, window=window)
                       if window else ops.packed_causal_attention(q, k, v, cu, T, scale))
        rows.append({"check": f"packed flex window={window}",
                     "path": "flex" if not ops._FLEX["failed"] else "sdpa-mask",
                     "rel_o": rel_err(o, ref), "rel_dq": rel_err(dq, rq), "rel_dk": rel_err(dk, rk),
                     "rel_dv": rel_err(dv, rv), "fwd_ms": ms})
    # chunked prefill: 2048 new queries over 6144 keys
    Tq, Tk = 2048, 6144
    q = torch.randn(1, Tq, H, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(1, Tk, Hkv, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    o = ops.chunk_prefill_attention(q, k, v, scale)
    mask = torch.ones(Tq, Tk, dtype=torch.bool, device=dev).tril(diagonal=Tk - Tq)[None, None]
    ref = ops.sdpa(q.float(), k.float(), v.float(), mask=mask, scale=scale)
    rows.append({"check": "chunk prefill (lower-right)", "path": "sdpa causal_lower_right",
                 "rel_o": rel_err(o, ref)})
    # decode: one query over the cache, GQA in place
    q1 = torch.randn(1, 1, H, D, device=dev, dtype=torch.bfloat16)
    o = ops.sdpa(q1, k, v, scale=scale)
    kk, vv = (t.float().repeat_interleave(H // Hkv, dim=2) for t in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q1.float().transpose(1, 2),
                                                           kk.transpose(1, 2),
                                                           vv.transpose(1, 2),
                                                           scale=scale).transpose(1, 2)
    rows.append({"check": "decode sdpa enable_gqa", "path": "sdpa flash", "rel_o": rel_err(o, ref)})
    print_table(rows, "CUDA attention paths vs fp32 explicit-mask reference")
    write_result("attention_gpu",
                 {"rows": rows, "worst_rel_err": max(v for r in rows for kk_, v in r.items()
                                                     if kk_.startswith("rel_"))})


if __name__ == "__main__":
    no_options(__doc__)
    main()
