"""Kernels per decode step: a CPU proxy for the fixed cost of a CUDA-graph decode step.

On an H200 a captured decode step costs ~7.4 ms at every context (BENCHMARKS.md): the time of ~2,000
tiny kernels, each a few µs as a graph node. This script counts them without a GPU. It profiles one
static decode step of the teacher shape and of HypeNet-2B (28 layers, the real attention/RNN layout;
tiny widths, bf16) on CPU, and counts the leaf ATen ops that launch a kernel on CUDA. Views, no-op
casts, allocations CPU-only fills and 0-dim scalar copies are skipped; ops that are one fused kernel
on CUDA (``_fused_rms_norm``) count once.
The ratio between two code versions predicts the change of the fixed cost; the GPU time is measured
by bench_inference.py.

  .venv/bin/python bench/count_decode_kernels.py
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import ATTN_2B, print_table  # noqa: E402
from halo_dist.models.hypenet.configuration_hypenet import HypeNetConfig  # noqa: E402
from halo_dist.models.hypenet.cache_hypenet import HypeNetCache  # noqa: E402
from halo_dist.models.hypenet.modeling_hypenet import HypeNetForCausalLM  # noqa: E402
from halo_dist.models.hypenet.static_decode import DecodeOptions, StaticDecoder  # noqa: E402

NO_KERNEL = {
    "aten::view", "aten::reshape", "aten::expand", "aten::transpose", "aten::slice", "aten::select",
    "aten::unsqueeze", "aten::squeeze", "aten::as_strided", "aten::_unsafe_view", "aten::t",
    "aten::permute", "aten::detach", "aten::detach_", "aten::alias", "aten::empty",
    "aten::empty_strided", "aten::split", "aten::chunk", "aten::narrow", "aten::lift_fresh",
    "aten::resolve_conj", "aten::resolve_neg", "aten::_reshape_alias", "aten::result_type",
    "aten::to", "aten::resize_", "aten::fill_", "aten::zero_",
    "aten::item", "aten::_local_scalar_dense", "aten::is_nonzero",
}
FUSED_ON_CUDA = {"aten::_fused_rms_norm"}
SHAPE = dict(num_hidden_layers=28, hidden_size=64, intermediate_size=128, num_attention_heads=16,
             num_key_value_heads=8, head_dim=16, vocab_size=512, tie_word_embeddings=True)


def configs() -> dict[str, HypeNetConfig]:
    L = SHAPE["num_hidden_layers"]
    return {
        "qwen3-1.7b-shape": HypeNetConfig(**SHAPE, mixer_types=["attention"] * L, attn_rope=True,
                                          attn_logits_scale_base=None,
                                          attn_output_gate=False, rope_theta=1e6),
        "hypenet-2b": HypeNetConfig(
            **SHAPE, mixer_types=["attention" if i in ATTN_2B else "lightning" for i in range(L)],
            attn_rope=False, attn_logits_scale_base=500.0, rope_theta=1e6),
    }


def kernels(events) -> Counter:
    """Leaf kernel-launching ops; the children of a CUDA-fused op are not counted."""
    counts: Counter = Counter()

    def visit(e):
        if e.name in FUSED_ON_CUDA:
            counts[e.name] += 1
            return
        children = [c for c in e.cpu_children if c.name.startswith("aten::")]
        if not children:
            scalar_only = bool(e.input_shapes) and all(shape == [] for shape in e.input_shapes)
            if e.name.startswith("aten::") and e.name not in NO_KERNEL and not scalar_only:
                # (CPU wraps Python scalars in 0-dim copies; CUDA passes them as arguments)
                counts[e.name] += 1
            return
        for c in children:
            visit(c)

    for e in events:
        if e.name.startswith("aten::") and not (e.cpu_parent
                                                and e.cpu_parent.name.startswith("aten::")):
            visit(e)
    return counts


def count(cfg: HypeNetConfig) -> Counter:
    torch.manual_seed(0)
    model = HypeNetForCausalLM(cfg).to(torch.bfloat16).eval()
    cache = HypeNetCache(cfg.num_hidden_layers, reserve_tokens=8)
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (1, 32)), cache=cache, use_cache=True)
    dec = StaticDecoder(model, cache, DecodeOptions(use_cuda_graph=False))
    dec.step(torch.tensor([1]))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        dec.step(torch.tensor([1]))
    return kernels(prof.events())


def main() -> list[dict]:
    rows = []
    for name, cfg in configs().items():
        c = count(cfg)
        rows.append({"model": name, "kernels_per_step": sum(c.values()),
                     "per_layer": round(sum(c.values()) / cfg.num_hidden_layers, 1),
                     "top": ", ".join(f"{k.removeprefix('aten::')} {v}"
                                      for k, v in c.most_common(6))})
    print_table(rows, "kernel launches per static decode step (CPU proxy, bf16, 28 layers)")
    return rows


if __name__ == "__main__":
    main()
