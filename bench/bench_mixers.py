"""The sweep mixers on the GPU: fla kernels vs the exact torch references, and layer timings.

    # on the H200 (fla + CUDA): writes bench/results/mixers.json
    python bench/bench_mixers.py
    python bench/bench_mixers.py --smoke  # tiny shapes on CPU (torch paths only): checks the script

Part 1 (correctness, H=16 heads x d_h=128, bf16 inputs, fp32 gates): for GDN, GLA, RWKV-7 and Mamba2
the dispatcher ops_rnn.<mixer>_attention as training calls it (fla, or the Hopper fallback: the
``path`` column says which ran) vs the fp32 torch reference: relative error of the output, the final
state and the gradients of q, k, v and the gates; then forward-only (inference always runs fla), a
packed batch (cu_seqlens) and 32 decode steps (fla fused_recurrent). Cases whose fla training path
is refused (fla 0.6 + Hopper + Triton < 3.7.1) are also run once with fla forced, to record the
refusal.
Part 2 (speed): forward+backward of one whole mixer layer (d=2048, 16 x 128 heads, batch 1, bf16) at
T=4096 for every mixer type, plus the raw kernels.
fla autotunes every kernel on first use (minutes): warm-up calls come before timing.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import log, print_table, rel_err, time_cuda, write_result  # noqa: E402
from halo_dist.models.hypenet import HypeNetConfig  # noqa: E402
from halo_dist.models.hypenet import ops_rnn as ops  # noqa: E402
from halo_dist.models.hypenet import ops_rnn_torch as ref  # noqa: E402
from halo_dist.models.hypenet.layers_hypenet import SequenceInfo  # noqa: E402
from halo_dist.models.hypenet.modeling_hypenet import MIXER_CLASSES  # noqa: E402

KINDS = ("gdn", "gla", "rwkv7", "mamba2")
DISPATCH = {"gla": ops.gla_attention, "mamba2": ops.mamba2_attention,
            "gdn": ops.gated_delta_attention, "rwkv7": ops.rwkv7_attention}


def make_inputs(kind: str, T: int, H: int, D: int, device, seed: int = 0):
    """(q, k, v, *gates) fp32 on ``device``, with gate ranges as the mixers produce them."""
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    ru = lambda *s: torch.rand(*s, generator=g)  # noqa: E731
    q, k, v = rn(1, T, H, D), rn(1, T, H, D), rn(1, T, H, D)
    q, k = F.normalize(q, dim=-1) * D**0.5, F.normalize(k, dim=-1) * D**0.5  # what QK-norm gives
    if kind == "gla":
        gates = [F.logsigmoid(rn(1, T, H, D) + 3) / 16]
    elif kind == "mamba2":
        gates = [-(ru(1, T, H) * 0.2 + 0.005)]
    elif kind == "gdn":
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        gates = [-(ru(1, T, H) * 0.2 + 0.005), ru(1, T, H)]
    else:
        kk = F.normalize(rn(1, T, H, D), dim=-1)
        a = ru(1, T, H, D)
        gates = [ops.RWKV7_LOG_DECAY_MIN * ru(1, T, H, D), -kk, kk * a]
    return [t.to(device) for t in (q, k, v, *gates)]


def reference(kind, xs, scale, cu=None, init=None):
    """The fp32 torch reference for one mixer (chunked where a chunked form exists)."""
    if kind == "gla":
        return ref.gla_chunk_torch(*xs, scale, init, cu, chunk_size=16)
    if kind == "mamba2":
        return ref.lightning_chunk_torch(*xs, scale, init, cu, chunk_size=64)
    if kind == "gdn":
        return ref.gdn_chunk_torch(*xs, scale, init, cu, chunk_size=64)
    q, k, v, w, a, b = xs
    return ref.dplr_torch(q, k, v, a, b, w, scale, init, cu)


def fast_inputs(kind, xs, dtype):
    """bf16 q/k/v (and GDN's beta, RWKV-7's a/b); decays stay fp32 as the mixers pass them."""
    keep_fp32 = {"gla": {3}, "mamba2": {3}, "gdn": {3}, "rwkv7": {3}}[kind]
    return [t.detach().clone() if i in keep_fp32 else t.detach().to(dtype)
            for i, t in enumerate(xs)]


def path_of(kind: str, device: str, training: bool) -> str:
    if kind in ("attention", "swa"):
        return "flash-attn / flex / sdpa"
    if device != "cuda" or not ops._HAS_FLA:
        return "torch"
    if kind == "lightning":
        return "fla chunk_simple_gla(g_gamma)"
    refused = training and ops._fla_gated_backward_broken(torch.cuda.current_device())
    if kind == "gdn":
        return "torch chunked (Hopper fallback)" if refused else "fla chunk_gated_delta_rule"
    if kind == "mamba2":
        return "fla chunk_gla (Hopper fallback)" if refused else "fla chunk_simple_gla(g)"
    return {"gla": "fla chunk_gla", "rwkv7": "fla chunk_rwkv7"}[kind]


def train_check(kind, T, H, D, device, dtype, cu=None):
    """Errors of o, state and every input gradient: dispatcher (training) vs the fp32 reference."""
    xs = make_inputs(kind, T, H, D, device)
    scale = D**-0.5
    do = torch.randn_like(xs[2])
    res = []
    for fast in (True, False):
        ins = [t.requires_grad_()
               for t in (fast_inputs(kind, xs, dtype) if fast else [t.clone() for t in xs])]
        o, s = (DISPATCH[kind](*ins, scale, cu_seqlens=cu) if fast
                else reference(kind, ins, scale, cu))
        (o.float() * do).sum().backward()
        res.append([o.float(), s.float()] + [t.grad.float() for t in ins])
    names = ["o", "state", "dq", "dk", "dv"] + [f"d{n}" for n in GATE_NAMES[kind]]
    return {n: rel_err(a, b) for n, a, b in zip(names, *res)}


GATE_NAMES = {"gla": ["gk"], "mamba2": ["g"], "gdn": ["g", "beta"], "rwkv7": ["w", "a", "b"]}


@torch.no_grad()
def forward_check(kind, T, H, D, device, dtype, cu=None):
    xs = make_inputs(kind, T, H, D, device, seed=1)
    o, s = DISPATCH[kind](*fast_inputs(kind, xs, dtype), D**-0.5, cu_seqlens=cu)
    o_ref, s_ref = reference(kind, xs, D**-0.5, cu)
    return {"o": rel_err(o.float(), o_ref), "state": rel_err(s.float(), s_ref)}


@torch.no_grad()
def decode_check(kind, H, D, device, dtype, steps=32):
    xs = make_inputs(kind, steps, H, D, device, seed=2)
    init = torch.randn(1, H, D, D, device=device) * 0.1
    fx = fast_inputs(kind, xs, dtype)
    s, outs = init, []
    for t in range(steps):
        o, s = DISPATCH[kind](*(x[:, t : t + 1] for x in fx), D**-0.5, initial_state=s, decode=True)
        outs.append(o.float())
    o_ref, s_ref = reference(kind, xs, D**-0.5, init=init)
    return {"o": rel_err(torch.cat(outs, 1), o_ref), "state": rel_err(s.float(), s_ref)}


def refused_check(kind, T, H, D, device, dtype):
    """With HYPENET_FLA_GATED_BWD=1 the dispatcher calls fla's gated backward anyway: record what
    fla does."""
    os.environ["HYPENET_FLA_GATED_BWD"] = "1"
    ops._fla_gated_backward_broken.cache_clear()
    try:
        return {"fla_forced": "ran", **train_check(kind, T, H, D, device, dtype)}
    except Exception as e:  # noqa: BLE001 - the point is to record the refusal
        return {"fla_forced": f"{type(e).__name__}: {str(e)[:120]}"}
    finally:
        os.environ.pop("HYPENET_FLA_GATED_BWD")
        ops._fla_gated_backward_broken.cache_clear()


def layer_timings(device, T, d, H, Hkv, D, dtype, kinds):
    """Forward+backward ms of one mixer layer, batch 1, T tokens (the whole module: projections
    included)."""
    rows = []
    for kind in kinds:
        cfg = HypeNetConfig(hidden_size=d, num_attention_heads=H, num_key_value_heads=Hkv,
                            head_dim=D, num_hidden_layers=2, mixer_types=["attention", kind],
                            sliding_window=512)
        layer = MIXER_CLASSES[kind](cfg, 1).to(device=device, dtype=dtype)
        if hasattr(layer, "init_mixer_parameters"):
            layer.init_mixer_parameters()
        x = torch.randn(1, T, d, device=device, dtype=dtype, requires_grad=True)
        info = SequenceInfo(position_ids=torch.arange(T, device=device)[None])

        def step(layer=layer, x=x):  # bound now: both are deleted after this size
            layer(x, info).float().sum().backward()

        try:
            ms = time_cuda(step, warmup=2, iters=5)
            rows.append({"mixer": kind, "tokens": T, "fwd_bwd_ms": ms,
                         "path": path_of(kind, device, True)})
        except Exception as e:  # noqa: BLE001 - one failing mixer must not hide the others' numbers
            rows.append({"mixer": kind, "tokens": T, "fwd_bwd_ms": None,
                         "path": f"error: {e}"[:120]})
            traceback.print_exc()
        log(f"timed {rows[-1]}")
        del layer, x
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def kernel_timings(device, T, H, D, dtype, kinds=KINDS):
    rows = []
    for kind in kinds:
        xs = [t.requires_grad_() for t in fast_inputs(kind, make_inputs(kind, T, H, D, device),
                                                      dtype)]

        def step():
            o, _ = DISPATCH[kind](*xs, D**-0.5, output_final_state=False)
            o.float().sum().backward()

        rows.append({"kernel": kind, "tokens": T, "fwd_bwd_ms": time_cuda(step, warmup=2, iters=5),
                     "path": path_of(kind, device, True)})
        log(f"timed kernel {rows[-1]}")
    return rows


def check_mixers(kinds: list[str], Tc: int, H: int, D: int, device: str, dtype,
                 hopper_refuses: bool, rows: list[dict], save) -> None:
    """Every correctness case of each mixer against the torch reference, one row each (an error
    is recorded in its row, and the next case runs); ``save`` after each mixer."""
    cu = torch.tensor([0, Tc // 8, Tc // 2, Tc // 2 + 7, Tc], dtype=torch.int32, device=device)
    for kind in kinds:
        checks = [("train", lambda: train_check(kind, Tc, H, D, device, dtype)),
                  ("forward", lambda: forward_check(kind, Tc, H, D, device, dtype)),
                  ("packed forward", lambda: forward_check(kind, Tc, H, D, device, dtype, cu)),
                  ("packed train", lambda: train_check(kind, Tc, H, D, device, dtype, cu)),
                  ("decode 32 steps", lambda: decode_check(kind, H, D, device, dtype))]
        if hopper_refuses and kind in ("gdn", "mamba2"):
            checks.append(("train, fla forced",
                           lambda: refused_check(kind, Tc, H, D, device, dtype)))
        for case, check in checks:
            training = case.startswith(("train", "packed train"))
            log(f"checking {kind} {case} (the first call of a kernel autotunes it)")
            try:
                row = {"mixer": kind, "case": case, "path": path_of(kind, device, training),
                       **check()}
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row = {"mixer": kind, "case": case, "path": path_of(kind, device, training),
                       "error": str(e)[:200]}
            rows.append(row)
            log(f"checked {row}")
        save()


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on CPU (torch paths only): checks the script")
    ap.add_argument("--tokens", type=int, default=4096, help="sequence length of the timings")
    ap.add_argument("--check-tokens", type=int, default=1024,
                    help="sequence length of the correctness checks")
    ap.add_argument("--mixers", default=",".join(KINDS),
                    help="comma list of the mixers to check and time (a run cut short can continue "
                         "with the rest)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kinds = [k.strip() for k in args.mixers.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        ap.error(f"unknown mixers {unknown}; choose from {', '.join(KINDS)}")
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if device == "cuda" and not ops._HAS_FLA:
        sys.exit("fla is not importable on this CUDA machine: install flash-linear-attention")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cuda":
        Tc, T, H, D, d, Hkv = args.check_tokens, args.tokens, 16, 128, 2048, 8
    else:
        Tc, T, H, D, d, Hkv = 24, 32, 2, 16, 64, 1
    name = "mixers" if device == "cuda" else "mixers_cpu_smoke"
    hopper_refuses = (device == "cuda"
                      and ops._fla_gated_backward_broken(torch.cuda.current_device()))
    result = {"shapes": {"check_tokens": Tc, "tokens": T, "heads": H, "head_dim": D, "hidden": d},
              "fla_gated_backward_refused": hopper_refuses, "correctness": [], "layer_timing": [],
              "kernel_timing": []}

    def save():  # after every section, so a run cut short still leaves its numbers
        return write_result(name, result, out=args.out)

    check_mixers(kinds, Tc, H, D, device, dtype, hopper_refuses, result["correctness"], save)
    result["kernel_timing"] = kernel_timings(device, T, H, D, dtype, kinds)
    save()
    result["layer_timing"] = layer_timings(device, T, d, H, Hkv, D, dtype,
                                           ["attention", "swa", "lightning", *kinds])
    path = save()
    cols = ["mixer", "case", "path", "o", "state", "dq", "dk", "dv"]
    print_table([{c: r.get(c) for c in cols} for r in result["correctness"]],
                "dispatcher (bf16) vs torch reference (fp32): relative error")
    print_table(result["kernel_timing"], "forward+backward of the kernel alone (ms), batch 1")
    print_table(result["layer_timing"], "forward+backward of one mixer layer (ms), batch 1")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
