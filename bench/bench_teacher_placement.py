"""Benchmark: a frozen Qwen3-8B-shape teacher replicated on every GPU vs sharded by ZeRO-3.

The teacher is what ``parallel.teacher_placement`` places: the exact all-attention HypeNet of a
random teacher (``models.convert.EXACT_TEACHER``: RoPE on, no logits scaling, no output gates), here
built directly as ``HypeNetForCausalLM(HypeNetConfig(**SHAPE_8B, mixer_types=["attention"] * 36,
**EXACT_TEACHER))`` on the GPU (fp32 init from a fixed seed, then cast to bf16, as the engine's
``teacher.to(device, dtype)``; a random Qwen3-8B through transformers on the CPU would take minutes)
-- frozen (``requires_grad_(False)``, eval). The two placements, one after the other in the same
job:

* ``replicated``: the full bf16 copy on every rank (the engine's default).
* ``zero3``: ``initialize_engine(teacher, frozen_teacher_zero3_config(...), groups)`` with the
  project's ``ProcessGroups`` (sp=1, dp=world): the engine's own code path. DeepSpeed without an
  optimizer wraps it in ``DeepSpeedZeRoOffload``: each rank keeps 1/world of every parameter and the
  forward hooks all-gather each module's parameters just in time (persistence threshold 0).

Each rank then runs ``--iters`` timed forwards (after ``--warmup``) under ``torch.no_grad()`` of its
own packed micro-batch ``[micro, seq]`` called as ``stages/distill.py`` calls the teacher
(``return_hidden_only=True``, no lm_head): random token ids, every row cut into documents of
``--doc-len`` tokens by ``data.packing.pack_batch`` -- position_ids restart at 0 per document and
``cu_seqlens`` runs over the flattened ``micro*seq`` tokens, as the loader hands them to the engine.

Recorded per placement: parameter bytes held per rank (ZeRO-3: the local ``ds_tensor`` shards,
padding included), steady ``memory_allocated`` between forwards, ``max_memory_allocated`` over the
forwards (peak stats reset after placement; the fp32 build is not counted), ms per forward (median
over iterations of the slowest rank: per-iteration times are ``all_reduce(MAX)``-ed), tokens/s per
GPU and in total (DP: every rank its own micro-batch). Both placements build the teacher from the
same seed (a weight fingerprint is compared across ranks) and run the same input, so their hidden
states must agree: ``hidden_max_abs_diff`` / ``hidden_rel_err`` (max over ranks).

Writes ``bench/results/multigpu_teacher_placement.json`` (top-level ``replicated_peak_gib``,
``zero3_peak_gib``, ``replicated_tokens_per_s_per_gpu``, ``zero3_tokens_per_s_per_gpu``,
``hidden_rel_err`` ...) or ``--out``.

  torchrun --standalone --nproc_per_node 2 bench/bench_teacher_placement.py  # 2 H200, NCCL
  torchrun --standalone --nproc_per_node 2 bench/bench_teacher_placement.py --micro 4 --seq 4096
  # gloo, tiny fp32
  torchrun --standalone --nproc_per_node 2 bench/bench_teacher_placement.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import SHAPE_8B, SHAPE_TINY, print_table, rel_err, sync, write_result  # noqa: E402
from halo_dist.data.packing import pack_batch  # noqa: E402
from halo_dist.models.hypenet import HypeNetConfig, HypeNetForCausalLM  # noqa: E402
from halo_dist.parallel import ProcessGroups  # noqa: E402
from halo_dist.parallel.deepspeed_setup import (  # noqa: E402
    frozen_teacher_zero3_config,
    init_distributed,
    initialize_engine,
)
from halo_dist.models.convert import EXACT_TEACHER  # noqa: E402

PLACEMENTS = ("replicated", "zero3")
GIB = 2**30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro", type=int, default=8, help="rows per rank per forward")
    p.add_argument("--seq", type=int, default=2048, help="tokens per row")
    p.add_argument("--doc-len", type=int, default=512,
                   help="packed document length (position_ids restart)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0,
                   help="teacher weights (same on every rank and placement)")
    p.add_argument("--placements", nargs="+", choices=PLACEMENTS, default=list(PLACEMENTS))
    p.add_argument("--cpu-smoke", action="store_true", help="tiny fp32 teacher on CPU ranks (gloo)")
    p.add_argument("--out", default=None,
                   help="result path (default bench/results/multigpu_teacher_placement.json)")
    a = p.parse_args(argv)
    if a.cpu_smoke:
        a.micro, a.seq, a.doc_len, a.iters, a.warmup = 2, 128, 32, 2, 1
        a.out = a.out or "/tmp/multigpu_teacher_placement_cpu_smoke.json"
    if a.seq % a.doc_len:
        p.error(f"--seq {a.seq} is not a multiple of --doc-len {a.doc_len}")
    return a


def teacher_config(smoke: bool) -> HypeNetConfig:
    """The exact all-attention HypeNet of a Qwen3 teacher (what ``as_exact_hypenet`` builds)."""
    shape = SHAPE_TINY if smoke else SHAPE_8B
    return HypeNetConfig(**shape, mixer_types=["attention"] * shape["num_hidden_layers"],
                         rope_theta=1e6, **EXACT_TEACHER)


def build_teacher(cfg: HypeNetConfig, device: torch.device, dtype: torch.dtype,
                  seed: int) -> HypeNetForCausalLM:
    torch.manual_seed(seed)  # every rank and both placements: the same weights
    with torch.device(device):
        model = HypeNetForCausalLM(cfg)
    model = model.to(dtype)  # fp32 init, then cast (the engine's teacher.to(device, dtype))
    model.requires_grad_(False)
    return model.eval()


def packed_batch(cfg: HypeNetConfig, a, rank: int, device: torch.device) -> dict:
    """Rank ``rank``'s micro-batch: random tokens in documents of ``doc_len`` (``pack_batch``)."""
    rng = np.random.default_rng(1000 + rank)
    n = a.micro * a.seq
    tokens = rng.integers(0, cfg.vocab_size, size=n, dtype=np.int64)  # [micro*seq]
    b = pack_batch(tokens, np.arange(0, n, a.doc_len), a.micro, a.seq)
    return {"input_ids": torch.from_numpy(b["input_ids"]).to(device),  # [micro, seq]
            "position_ids": torch.from_numpy(b["position_ids"]).to(device),  # [micro, seq]
            # [micro*seq/doc_len + 1] int32
            "cu_seqlens": torch.from_numpy(b["cu_seqlens"]).to(device),
            "max_seqlen": b["max_seqlen"]}


def forward(model, batch: dict) -> torch.Tensor:
    """The teacher call of ``StudentWithLoss.forward``: final hidden states ``[micro, seq, d]``."""
    with torch.no_grad():
        return model(batch["input_ids"], position_ids=batch["position_ids"],
                     cu_seqlens=batch["cu_seqlens"], max_seqlen=batch["max_seqlen"],
                     return_hidden_only=True)


def local_param_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds: ZeRO-3's local shard (``ds_tensor``), else the full
    tensor."""
    total = 0
    for p in model.parameters():
        t = getattr(p, "ds_tensor", None)
        t = p if t is None else t
        total += t.numel() * t.element_size()
    return total


def full_numel(model: torch.nn.Module) -> int:
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())


def fingerprint(model: torch.nn.Module) -> float:
    """A weight checksum (fp64 sum of all parameters), to check every rank built the same
    teacher."""
    return float(sum(p.detach().sum(dtype=torch.float64) for p in model.parameters()))


def reduce(values: list[float], device, op=dist.ReduceOp.MAX) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def free_memory(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run_placement(placement: str, cfg, a, groups: ProcessGroups, device, dtype,
                  batch) -> tuple[dict, torch.Tensor]:
    """Build, place and time one placement; returns (row, this rank's hidden states on the CPU)."""
    cuda = device.type == "cuda"
    world = dist.get_world_size()
    model = build_teacher(cfg, device, dtype, a.seed)
    fp = fingerprint(model)
    fp_max, neg_fp_min = reduce([fp, -fp], device)
    n_params = full_numel(model)
    engine = None
    if placement == "zero3":
        ds = frozen_teacher_zero3_config(a.micro, 1, a.micro * groups.layout.dp_size,
                                         bf16=dtype == torch.bfloat16)
        engine = initialize_engine(model, ds, groups)[0]
        engine.eval()
    free_memory(device)
    param_bytes = local_param_bytes(model)
    placed = torch.cuda.memory_allocated(device) if cuda else None

    for _ in range(a.warmup):  # the first ZeRO-3 forward also records DeepSpeed's prefetch trace
        forward(model, batch)
    sync(device)
    times = []
    for _ in range(a.iters):
        sync(device)
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        out = forward(model, batch)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        del out
    hidden = forward(model, batch).float().cpu()  # [micro, seq, d]
    sync(device)
    steady = torch.cuda.memory_allocated(device) if cuda else None
    peak = torch.cuda.max_memory_allocated(device) if cuda else None

    slowest = reduce(times, device)  # per-iteration time of the slowest rank
    ms = statistics.median(slowest)
    mem = reduce([param_bytes, placed or 0, steady or 0, peak or 0], device)
    tokens = a.micro * a.seq
    row = {
        "placement": placement,
        "params_b": n_params / 1e9,
        "param_gib_per_gpu": mem[0] / GIB,
        "placed_gib": mem[1] / GIB if cuda else None,
        "steady_gib": mem[2] / GIB if cuda else None,
        "peak_gib": mem[3] / GIB if cuda else None,
        "ms_per_forward": ms,
        "ms_per_forward_mean": statistics.fmean(slowest),
        "tokens_per_s_per_gpu": tokens / (ms / 1e3),
        "tokens_per_s_total": world * tokens / (ms / 1e3),
    }
    extra = {"param_bytes_per_gpu": int(mem[0]), "param_bytes_this_rank": param_bytes,
             "weight_fingerprint": fp, "weight_fingerprint_spread": fp_max + neg_fp_min,
             "ms_per_iter_slowest_rank": slowest}
    del engine, model
    free_memory(device)
    return {**row, **extra}, hidden


def zero3_vs_replicated(results: dict, hiddens: dict, device) -> dict:
    """ZeRO-3 against the replicated teacher: the hidden states' difference (the largest over the
    ranks; every rank calls this), and the parameter bytes, speed and peak memory of one against
    the other."""
    out = {}
    h0, h1 = hiddens["replicated"], hiddens["zero3"]
    diff, err = reduce([float((h0 - h1).abs().max()), rel_err(h1, h0)], device)
    out["hidden_max_abs_diff"], out["hidden_rel_err"] = diff, err
    # this rank's: not a vacuous match
    out["hidden_rms"] = float(h0.double().pow(2).mean().sqrt())
    r, z = results["replicated"], results["zero3"]
    out["zero3_param_fraction"] = z["param_bytes_per_gpu"] / r["param_bytes_per_gpu"]
    out["zero3_speed_vs_replicated"] = z["tokens_per_s_per_gpu"] / r["tokens_per_s_per_gpu"]
    if r["peak_gib"] is not None:
        out["zero3_peak_saving_gib"] = r["peak_gib"] - z["peak_gib"]
    return out


def main(argv=None) -> None:
    a = parse_args(argv)
    if "RANK" not in os.environ:  # plain `python bench/...`: a 1-rank job
        from halo_dist.parallel.env import ensure_distributed_env

        ensure_distributed_env()
    init_distributed(cpu=a.cpu_smoke)
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.cpu_smoke:
        device, dtype = torch.device("cpu"), torch.float32
    else:
        device, dtype = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))), torch.bfloat16
        torch.cuda.set_device(device)
    groups = ProcessGroups.build(sp_size=1)
    cfg = teacher_config(a.cpu_smoke)
    batch = packed_batch(cfg, a, rank, device)

    results, hiddens = {}, {}
    for placement in a.placements:
        results[placement], hiddens[placement] = run_placement(placement, cfg, a, groups, device,
                                                               dtype, batch)
        if rank == 0:
            r = results[placement]
            peak = f", peak {r['peak_gib']:.2f} GiB" if r["peak_gib"] is not None else ""
            print(f"{placement}: {r['ms_per_forward']:.1f} ms/forward{peak}", flush=True)

    payload = {
        "model": "qwen3-8b-shape exact teacher (all-attention HypeNet)"
        if not a.cpu_smoke else "tiny exact teacher",
        "shape": dict(SHAPE_TINY if a.cpu_smoke else SHAPE_8B, rope_theta=1e6),
        "dtype": str(dtype).replace("torch.", ""), "world_size": world,
        "backend": dist.get_backend(), "micro": a.micro, "seq": a.seq, "doc_len": a.doc_len,
        "tokens_per_forward_per_gpu": a.micro * a.seq, "iters": a.iters, "warmup": a.warmup,
        "input": "packed: random ids, documents of doc_len tokens, position_ids restart "
                 "per document, cu_seqlens over micro*seq (data.packing.pack_batch); "
                 "forward(return_hidden_only=True) under no_grad", "placements": results,
    }
    for name, r in results.items():
        for key in ("peak_gib", "steady_gib", "param_gib_per_gpu", "tokens_per_s_per_gpu",
                    "ms_per_forward"):
            payload[f"{name}_{key}"] = r[key]
    if len(hiddens) == 2:
        payload.update(zero3_vs_replicated(results, hiddens, device))
    if rank == 0:
        cols = ("placement", "params_b", "param_gib_per_gpu", "placed_gib", "steady_gib",
                "peak_gib", "ms_per_forward", "tokens_per_s_per_gpu", "tokens_per_s_total")
        print_table([{c: r[c] for c in cols} for r in results.values()],
                    f"frozen teacher placement, {world} ranks ({dist.get_backend()}), "
                    f"{payload['dtype']}, [{a.micro}, {a.seq}] per rank, documents of {a.doc_len}")
        if "hidden_rel_err" in payload:
            print("hidden states replicated vs zero3: max |diff| "
                  f"{payload['hidden_max_abs_diff']:.3g}, rel err {payload['hidden_rel_err']:.3g}")
        path = write_result("multigpu_teacher_placement" + ("_cpu_smoke" if a.cpu_smoke else ""),
                            payload, a.out)
        print(f"wrote {path}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
