"""The 512K decode speed-up of HypeNet-2B over the teacher shape, both timed in one process and
interleaved.

``profile_decode.py`` times one model per process; earlier calls ran HypeNet-2B first, on a cache it
had just prefilled for ~30 s at full power, and the teacher shape afterwards, in another process, on
a random cache. The two did not run under the same conditions: on the H200 the GEMV shapes
both models share timed 4-12% slower in HypeNet's process than in the teacher's (W_o 4.40 vs
3.94 µs), whatever the cause (clocks after the prefill, the device's state). A ratio of two step
times should compare them under the same conditions. Here both decoders live in
one process, over random caches of the same context (decode cost depends on a cache's size, not its
values; ``profile_decode.py --prefill`` is the check of the graph step against the eager one on real
keys), and are timed in alternating rounds: teacher, HypeNet, teacher, HypeNet, ... Each round times
``--steps`` graph replays of one model (the median of the host-synchronised steps, as
``profile_decode.timed``); the speed-up is the median over rounds of the teacher's step over
HypeNet's step of the same round, with the spread of the per-round ratios beside it.

Both decoders are the shipped ones (compiled step, CUDA graph, packed projections, the batch-1
GEMV where its tuning beat cuBLAS): the teacher keeps the best decode path we have. The GEMV tuning
runs once per weight shape in the process, so the shapes both models share get the same choice.

At 512K the two caches take ~75 GB (the teacher's 60 GB of keys and values): an H200, not an H100.

  python bench/decode_ratio.py --context 524288 --rounds 12 --steps 24
  python bench/decode_ratio.py --cpu-smoke        # tiny shapes on CPU (the script runs)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_inference import build, model_configs, sync  # noqa: E402
from bench.common import decode_bandwidth, print_table, write_result  # noqa: E402
from bench.inference.timing import random_cache  # noqa: E402
from bench.profile_decode import step_bytes, timed  # noqa: E402
from halo_dist.models.hypenet.static_decode import DecodeOptions, StaticDecoder  # noqa: E402

TEACHER, STUDENT = "qwen3-1.7b-shape", "hypenet-2b"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=524288)
    p.add_argument("--rounds", type=int, default=12, help="timed rounds per model, alternating")
    p.add_argument("--steps", type=int, default=24, help="graph replays per round")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="bytes/s for the bytes bound (default: this card's entry in "
                        "bench.common.DECODE_BANDWIDTH: H200 4.4e12, H100 3.35e12)")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.cpu_smoke:
        a.context, a.rounds, a.steps = 64, 3, 3
        a.out = a.out or "/tmp/halo_dist_decode_ratio_smoke.json"
    if a.rounds < 1 or a.steps < 2 or a.context < 1:
        p.error("--rounds >= 1, --steps >= 2 and --context >= 1")
    return a


def decoder(name: str, args, device, dtype):
    """(model, shipped compiled decoder over a random cache of ``args.context`` tokens with room
    for every timed step and the warm-up)."""
    model = build(model_configs(args.cpu_smoke)[name], device, dtype)
    room = args.rounds * args.steps + 16
    cache = random_cache(model, args.context, device, dtype, room)
    return model, StaticDecoder(model, cache, DecodeOptions(compile=device.type == "cuda"))


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.bandwidth = decode_bandwidth(args.bandwidth)
    device = torch.device("cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    models, decs = {}, {}
    with torch.inference_mode():
        for name in (TEACHER, STUDENT):
            models[name], decs[name] = decoder(name, args, device, dtype)
            token = torch.zeros(1, dtype=torch.long, device=device)
            decs[name].step(token)  # the compilation and first replay, untimed
        sync(device)
        times = {name: [] for name in decs}
        for _ in range(args.rounds):
            for name, dec in decs.items():  # teacher, then HypeNet, every round
                times[name].append(timed(dec, args.steps, device))
    ratios = [t / s for t, s in zip(times[TEACHER], times[STUDENT])]
    rows = []
    for name in decs:
        bound = step_bytes(models[name], args.context, 1)
        bound_ms = bound["total_GB"] * 1e9 / args.bandwidth * 1e3
        ms = statistics.median(times[name])
        rows.append({"model": name, "context": args.context, "step_ms": ms,
                     "min_ms": min(times[name]), "max_ms": max(times[name]),
                     "bound_ms": bound_ms, "vs_bound": ms / bound_ms,
                     "gemv": decs[name].gemv_report or None,
                     "graph": decs[name].graph is not None,
                     "error": decs[name].graph_error or decs[name].compile_error, **bound})
    print_table([{k: r[k] for k in ("model", "context", "step_ms", "min_ms", "max_ms", "bound_ms",
                                    "vs_bound")} for r in rows],
                f"decode at {args.context}: {args.rounds} alternating rounds of {args.steps} steps")
    speedup = statistics.median(ratios)
    print(f"\nspeed-up (median of per-round ratios): {speedup:.3f} "
          f"(rounds: min {min(ratios):.3f}, max {max(ratios):.3f}); ratio of medians "
          f"{rows[0]['step_ms'] / rows[1]['step_ms']:.3f}")
    payload = {"rows": rows, "context": args.context, "rounds": args.rounds,
               "steps": args.steps, "bandwidth_Bps": args.bandwidth, "times_ms": times,
               "round_ratios": ratios,
               "decode_speedup": speedup,
               "decode_bytes_bound_ratio": rows[1]["vs_bound"],
               "command": " ".join(sys.argv)}
    print(f"wrote {write_result('decode_ratio', payload, args.out)}")
    return payload


if __name__ == "__main__":
    main()
