"""Lightning attention on the GPU: fla kernels vs the exact torch reference, and layer timings.

    python bench/bench_lightning.py               # on the H200 (fla + CUDA)
    python bench/bench_lightning.py --cpu-smoke   # tiny shapes, torch path only (checks the script)

Part 1 (correctness, HypeNet-2B layer shapes H=16, d_h=128): fla ``chunk_simple_gla`` (bf16 inputs)
vs ``lightning_chunk_torch`` (fp32, the CPU implementation run on the GPU): relative error of the
output, final state and the q/k/v gradients, for dense, packed (cu_seqlens) and padded (per-token g)
inputs, and ``fused_recurrent_simple_gla`` decode steps; then a 4-layer HypeNet with 2B widths,
logits of the fla path vs the torch path.
Part 2 (speed): forward+backward of one Lightning layer vs one attention layer (SDPA/flash), d=2048,
batch 1, at 4K / 16K / 64K tokens.
Writes bench/results/lightning.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import log, print_table, rel_err, time_cuda, write_result  # noqa: E402
from halo_dist.models.hypenet import HypeNetConfig, HypeNetForCausalLM  # noqa: E402
from halo_dist.models.hypenet import ops_rnn as ops  # noqa: E402
from halo_dist.models.hypenet.attention_hypenet import HypeNetAttention  # noqa: E402
from halo_dist.models.hypenet.layers_hypenet import SequenceInfo  # noqa: E402
from halo_dist.models.hypenet.rnn_hypenet import LightningMixer  # noqa: E402


def make_qkv(T, H, D, device, seed=0, B=1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g)
    k = torch.randn(B, T, H, D, generator=g)
    v = torch.randn(B, T, H, D, generator=g)
    return [t.to(device) for t in (q, k, v)]


def run_pair(q, k, v, decay, scale, cu=None, mask=None, dtype=torch.bfloat16):
    """(fast path on dtype inputs) vs (torch reference in fp32): errors of o, state, dq, dk, dv."""
    do = torch.randn_like(q)
    results = []
    for fast in (True, False):
        xs = [t.detach().to(dtype if fast else torch.float32).requires_grad_() for t in (q, k, v)]
        saved = ops._HAS_FLA
        ops._HAS_FLA = saved and fast
        try:
            o, s = ops.lightning_attention(*xs, decay, scale, token_mask=mask, cu_seqlens=cu)
        finally:
            ops._HAS_FLA = saved
        (o.float() * do).sum().backward()
        results.append([o.float(), s.float()] + [t.grad.float() for t in xs])
    names = ["o", "state", "dq", "dk", "dv"]
    return {n: rel_err(a, b) for n, a, b in zip(names, *results)}


def correctness_cases(device, T, H, D):
    """(name, check) pairs, cheapest kernels first: dense/padded share fla's g_gamma kernels."""
    scale = D**-0.5
    decay = ops.lightning_log_decay(H, device)
    q, k, v = make_qkv(T, H, D, device)
    mask = torch.ones(1, T, dtype=torch.bool, device=device)
    mask[:, : T // 4] = False
    cu = torch.tensor([0, T // 8, T // 2, T // 2 + 7, T], dtype=torch.int32, device=device)
    return [
        (f"dense T={T}", lambda: run_pair(q, k, v, decay, scale)),
        ("left-padded (k=v=0 at pads)", lambda: run_pair(q, k, v, decay, scale, mask=mask)),
        ("decode 64 steps", lambda: decode_check(device, H, D, decay, scale)),
        ("packed 4 docs (cu_seqlens)", lambda: run_pair(q, k, v, decay, scale, cu=cu)),
    ]


@torch.no_grad()
def decode_check(device, H, D, decay, scale, steps=64):
    q, k, v = make_qkv(steps, H, D, device, seed=1)
    state0 = torch.randn(1, H, D, D, device=device) * 0.1
    outs = {}
    for fast in (True, False):
        saved = ops._HAS_FLA
        ops._HAS_FLA = saved and fast
        s, os_ = state0, []
        dt = torch.bfloat16 if fast else torch.float32
        for t in range(steps):
            o, s = ops.lightning_attention(*(x[:, t : t + 1].to(dt) for x in (q, k, v)), decay,
                                           scale, initial_state=s, decode=True)
            os_.append(o.float())
        ops._HAS_FLA = saved
        outs[fast] = (torch.cat(os_, 1), s.float())
    return {"o": rel_err(outs[True][0], outs[False][0]),
            "state": rel_err(outs[True][1], outs[False][1])}


@torch.no_grad()
def model_check(device, vocab=2048, T=2048):
    cfg = HypeNetConfig(
        vocab_size=vocab, hidden_size=2048, intermediate_size=6144, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        mixer_types=["attention", "lightning", "lightning", "lightning"],
    )
    torch.manual_seed(0)
    model = HypeNetForCausalLM(cfg).to(device)
    for m in model.modules():  # non-zero gates so every path matters
        if hasattr(m, "g_proj"):
            torch.nn.init.normal_(m.g_proj.weight, std=0.02)
    x = torch.randint(0, vocab, (2, T), device=device)
    ref = model.float()(x).logits.float()
    fast = model.to(torch.bfloat16)(x).logits.float()
    saved = ops._HAS_FLA
    ops._HAS_FLA = False
    # same bf16 model, torch Lightning path: separates kernel from dtype error
    torch_bf16 = model(x).logits.float()
    ops._HAS_FLA = saved
    return {"case": f"HypeNet 4 layers d=2048 B=2 T={T}", "fla_bf16_vs_fp32": rel_err(fast, ref),
            "torch_bf16_vs_fp32": rel_err(torch_bf16, ref)}


def layer_timings(device, lengths, d=2048, H=16, Hkv=8, D=128):
    cfg = HypeNetConfig(hidden_size=d, num_attention_heads=H, num_key_value_heads=Hkv, head_dim=D,
                        num_hidden_layers=2, mixer_types=["attention", "lightning"])
    rows = []
    for T in lengths:
        row = {"tokens": T}
        for name, cls in (("lightning", LightningMixer), ("attention", HypeNetAttention)):
            layer = cls(cfg, 0).to(device=device,
                                   dtype=torch.bfloat16 if device == "cuda" else torch.float32)
            x = torch.randn(1, T, d, device=device, dtype=next(layer.parameters()).dtype,
                            requires_grad=True)
            info = SequenceInfo(position_ids=torch.arange(T, device=device)[None])

            def step(layer=layer, x=x):  # bound now: the loop deletes both before the next size
                layer(x, info).sum().backward()

            row[f"{name}_ms"] = time_cuda(step, warmup=2, iters=5)
            log(f"timed {name} at T={T}: {row[f'{name}_ms']:.2f} ms")
            del layer, x
            if device == "cuda":
                torch.cuda.empty_cache()
        row["attn/lightning"] = row["attention_ms"] / row["lightning_ms"]
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes on CPU (no fla): checks the script runs")
    ap.add_argument("--lengths", default="4096,16384,65536")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda"
    if device == "cuda" and not ops._HAS_FLA:
        sys.exit("fla is not importable on this CUDA machine: install flash-linear-attention")
    T, H, D = (128, 4, 32) if device == "cpu" else (4096, 16, 128)
    lengths = [64, 256] if device == "cpu" else [int(t) for t in args.lengths.split(",")]
    name = "lightning" if device == "cuda" else "lightning_cpu_smoke"
    result = {"correctness": [], "model": [], "layer_timing": []}

    def save():  # after every section, so a run cut short still leaves its numbers
        errs = [v for r in result["correctness"]
                for k, v in r.items() if k != "case" and v is not None]
        result["max_kernel_rel_err"] = max(errs) if errs else None
        return write_result(name, result, out=args.out)

    log("checking kernels (fla autotunes on first use: minutes)")
    cases = correctness_cases(device, T, H, D)
    for case, check in cases[:3]:
        result["correctness"].append({"case": case, **check()})
        log(f"checked {result['correctness'][-1]}")
        save()
    shapes = dict(d=2048, H=16, Hkv=8, D=128) if device == "cuda" else dict(d=128, H=4, Hkv=2, D=32)
    for T_len in lengths:
        result["layer_timing"] += layer_timings(device, [T_len], **shapes)
        save()
    result["model"].append(model_check(device, vocab=256, T=64) if device == "cpu"
                           else model_check(device))
    log(f"model {result['model'][-1]}")
    save()
    for case, check in cases[3:]:
        result["correctness"].append({"case": case, **check()})
        log(f"checked {result['correctness'][-1]}")
    path = save()
    print_table(result["correctness"], "fla (bf16) vs torch reference (fp32): relative error")
    print_table(result["model"], "whole-model logits: relative error vs fp32 torch path")
    print_table(result["layer_timing"], "forward+backward of one layer (ms), batch 1")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
