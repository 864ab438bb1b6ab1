"""Does a rollout step go faster as two half-batches on two CUDA streams? (issue 20 item 4)

A batched rollout step of HypeNet-2B is mostly memory-bound kernels (the Lightning layers' fp32
states read and written, the attention layers' keys and values) with compute-bound GEMMs between
them: at 256 rows and a 1,280-token context (the mean context of a horizon-2048 rollout after a
256-token prompt), P24b's profile put the compiled step at 7.98 ms, 5.4 ms of it memory-bound
kernels and 1.79 ms GEMMs. Run one after the other, the two kinds add up; replayed as two groups'
graphs on two streams, one group's GEMMs can run while the other's kernels stream memory
(``continuous_rollouts(streams=2)``, ``opd.rollout_streams``).

For each ``--rows`` R, with random bf16 weights and a random cache of ``--context`` tokens:

* ``one``: one decoder of R rows (the shipped rollout step);
* ``k serial``: k decoders of R/k rows, replayed one after the other on one stream (what the split
  alone costs: smaller GEMMs, k launches);
* ``k streams``: the same k decoders, each replayed on its own stream (the overlap);
* ``k streams, first ahead``: the same with the first group's stream at a higher priority.

A round is what the rollout loop does per token: every decoder's tokens copied out to pinned memory,
its step and sampling (``sample_tokens``) queued on its stream, then every copy read on the host.
The figure is the mean over ``--rounds`` rounds, timed on the host between two device
synchronisations after the graphs were captured and one round ran untimed; the groups' graphs are
captured on their own streams and share one copy of the packed weights, as the rollouts build them.
``tokens/s`` = R / round time.

  python bench/overlap_streams.py --rows 256 512 --groups 2   # fp32 states written every 4 tokens
  python bench/overlap_streams.py --cpu-smoke     # tiny shapes on CPU: streams are a no-op there
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_inference import build, model_configs, sync  # noqa: E402
from bench.common import print_table, write_result  # noqa: E402
from bench.profile_decode import random_cache, step_bytes  # noqa: E402
from halo_dist.models.hypenet.static_decode import StaticDecoder  # noqa: E402
from halo_dist.stages.opd_rollouts import TokenReader, group_slots  # noqa: E402
from halo_dist.stages.rollout_sampling import sample_tokens  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[256, 512])
    p.add_argument("--groups", type=int, nargs="+", default=[2])
    p.add_argument("--context", type=int, default=1280)
    p.add_argument("--rounds", type=int, default=30, help="timed rounds per configuration")
    p.add_argument("--no-compile", action="store_true", help="plain graphs (compiled: shipped)")
    p.add_argument("--state-write-every", type=int, default=4,
                   help="Lightning states written back every n tokens (4: what "
                        "configs/opd/hypenet_2b.yaml ships for rollouts)")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def decoders(model, sizes: list[int], context: int, room: int, compile_step: bool, device,
             streams, write_every: int) -> list[StaticDecoder]:
    """A decoder of each size over its own random cache of ``context`` tokens (+ ``room``), the
    first one's packed weights shared, each graph captured on its own stream (as the rollouts
    build their groups)."""
    dtype = next(model.parameters()).dtype
    out = []
    for n, stream in zip(sizes, streams):
        cache = random_cache(model, n, context, device, dtype, room)
        out.append(StaticDecoder(model, cache, compile=compile_step, capture_stream=stream,
                                 packs=out[0].cache.packed if out else None,
                                 state_write_every=write_every))
    return out


def round_ms(decs, streams, rounds: int, device) -> float:
    """Mean ms of one round as ``continuous_rollouts`` runs it: every decoder's tokens copied out
    and its step and sampling queued, each on its stream (None: the caller's), then every
    decoder's copied tokens read on the host. Timed on the host between two device
    synchronisations, after an untimed round; each call starts from the caches' first
    position."""
    caller = torch.cuda.current_stream(device) if device.type == "cuda" else None
    for d in decs:
        d.cache.pos.fill_(d.cache.prompt_tokens)
        d.row_lengths = [d.cache.prompt_tokens] * len(d.row_lengths)
    tokens = [torch.zeros(d.tokens.shape[0], dtype=torch.long, device=device) for d in decs]
    readers = [TokenReader(t) for t in tokens]
    for s in streams:
        if s is not None:
            s.wait_stream(caller)

    def one_round():
        for i, (dec, s) in enumerate(zip(decs, streams)):
            with torch.cuda.stream(s) if s is not None else nullcontext():
                readers[i].start(tokens[i])
                tokens[i] = sample_tokens(dec.step(tokens[i]), 1.0, 1.0, None)
        for r in readers:
            r.read()

    one_round()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(rounds):
        one_round()
    for s in streams:
        if s is not None:
            caller.wait_stream(s)
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / rounds


def measure(model, rows: int, k: int, args, device) -> list[dict]:
    compile_step = not args.no_compile and device.type == "cuda"
    room = args.rounds + 9  # every step of one timing (each timing starts from the context)
    cuda = device.type == "cuda"
    out = []
    one = decoders(model, [rows], args.context, room, compile_step, device, [None],
                   args.state_write_every)
    base = round_ms(one, [None], args.rounds, device)
    out.append({"rows": rows, "config": "one", "round_ms": base})
    del one
    sizes = [len(r) for r in group_slots(rows, k)]
    plain = [torch.cuda.Stream(device) if cuda else None for _ in sizes]
    halves = decoders(model, sizes, args.context, room, compile_step, device, plain,
                      args.state_write_every)
    # the first group's stream ahead of the others: its kernels' blocks are dispatched first, the
    # others' fill the SMs it leaves (a way out of both groups running the same kind of kernel
    # at the same time)
    ranked = [torch.cuda.Stream(device, priority=-1 if i == 0 else 0) if cuda else None
              for i in range(k)]
    out.append({"rows": rows, "config": f"{k} serial",
                "round_ms": round_ms(halves, [None] * k, args.rounds, device)})
    out.append({"rows": rows, "config": f"{k} streams",
                "round_ms": round_ms(halves, plain, args.rounds, device)})
    out.append({"rows": rows, "config": f"{k} streams, first ahead",
                "round_ms": round_ms(halves, ranked, args.rounds, device)})
    del halves
    for r in out:
        r["tokens_per_s"] = rows / r["round_ms"] * 1e3
        r["vs_one"] = base / r["round_ms"]
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device("cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda")
    if args.cpu_smoke:
        args.rows, args.context, args.rounds = [4], 24, 12
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = build(model_configs(args.cpu_smoke)["hypenet-2b"], device, dtype)
    rows = []
    with torch.inference_mode():
        for r in args.rows:
            for k in args.groups:
                rows += measure(model, r, k, args, device)
    for r in rows:
        r.update(step_bytes(model, args.context, r["rows"]))
    print_table([{k: r[k] for k in ("rows", "config", "round_ms", "tokens_per_s", "vs_one")}
                 for r in rows], f"rollout step at context {args.context}: one decoder vs groups")
    payload = {"rows": rows, "context": args.context, "compiled": not args.no_compile,
               "state_write_every": args.state_write_every,
               "command": " ".join(sys.argv)}
    print(f"\nwrote {write_result('overlap_streams', payload, args.out)}")
    return payload


if __name__ == "__main__":
    main()
