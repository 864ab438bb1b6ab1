"""Benchmark: the Ulysses all-to-all cost of a HypeNet-2B stage-3 step.

Times our ``SequenceParallel.seq_to_head`` / ``head_to_seq`` on the real per-layer shapes (q/k/v/o
of 16 heads x 128, bf16, micro-batch 1) at 16K / 32K / 64K context on all ranks (NCCL), and counts
the calls of one micro-step: every layer of the student does 4 exchanges forward (q, k, v in, o out;
the RNN layers have 16 k/v heads after GQA->MHA, the attention layers 8) and 4 backward, plus 4 more
when activation checkpointing recomputes the forward; every teacher layer 4 forward. The total is
set against the step time of the matching ``bench/results/stages_sp2*.json`` run, when present.

  torchrun --standalone --nproc_per_node 2 bench/bench_a2a.py
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import RESULTS, no_options, print_table, time_cuda, write_result  # noqa: E402
from halo_dist.parallel.ulysses import SequenceParallel  # noqa: E402

LAYERS, ATTN, HEADS, KV_HEADS, D = 28, 7, 16, 8, 128


def exchange_ms(sp: SequenceParallel, T: int, heads: int) -> float:
    x = torch.randn(1, T // sp.world_size, heads, D, device="cuda", dtype=torch.bfloat16)
    return time_cuda(lambda: sp.seq_to_head(x), warmup=3, iters=10)


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    sp = SequenceParallel(dist.group.WORLD)
    rows = []
    for T in (16384, 32768, 65536):
        full, kv = exchange_ms(sp, T, HEADS), exchange_ms(sp, T, KV_HEADS)
        # per forward of a layer: q + o at 16 heads; k + v at 16 (RNN) or 8 (attention) heads
        rnn_fwd, attn_fwd = 4 * full, 2 * full + 2 * kv
        student_fwd = (LAYERS - ATTN) * rnn_fwd + ATTN * attn_fwd
        teacher_fwd = LAYERS * (2 * full + 2 * kv)
        per_micro = {"no_ckpt": 2 * student_fwd + teacher_fwd,
                     "ckpt": 3 * student_fwd + teacher_fwd}
        rows.append({"context": T, "sp": world, "a2a_16h_ms": full, "a2a_8h_ms": kv,
                     "a2a_per_micro_ms": per_micro["no_ckpt"],
                     "a2a_per_micro_ckpt_ms": per_micro["ckpt"]})
    for row in rows:
        tag = "sp2" if row["context"] == 16384 else f"sp2_{row['context'] // 1024}k"
        path = RESULTS / f"stages_{tag}.json"
        if path.exists():
            s3 = json.loads(path.read_text()).get("stage3", {})
            if s3.get("step_time_s"):
                # bench_stages: stage3 batch 2, dp 1
                grad_accum = 2 if row["context"] == 16384 else 2
                micro_s = s3["step_time_s"] / grad_accum
                key = ("a2a_per_micro_ckpt_ms" if s3.get("activation_checkpointing")
                       else "a2a_per_micro_ms")
                row["step_share"] = row[key] / 1e3 / micro_s
    if rank == 0:
        print_table(rows, f"Ulysses all-to-all, {world} GPUs, bf16, micro-batch 1")
        write_result("multigpu_a2a", {"rows": rows})
    dist.destroy_process_group()


if __name__ == "__main__":
    no_options(__doc__)
    main()
