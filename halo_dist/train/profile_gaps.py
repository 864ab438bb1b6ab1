"""Where the GPU waits: idle gaps between kernels in a torch.profiler Chrome trace.

A step whose device-busy fraction is below 1 leaves the GPU idle somewhere. The profile's operator
tables do not say where: this module walks the trace's device timeline (kernels, memcpys and
memsets of every stream merged), keeps the gaps longer than ``min_gap_us``, and names each one by
the host operator whose launch ended it (the trace links every device event to its launching
operator through the ``External id``) and by the host-device synchronisation, if any, that
returned just before it began (the host drained the queue there, then had to refill it).

    python -m halo_dist.train.profile_gaps runs/x/profile/trace.json --steps 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
TOP = 12


def _device_intervals(events: list[dict]) -> list[tuple[float, float, dict]]:
    """``(start, end, event)`` of every device event, sorted by start (µs)."""
    rows = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e)
            for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    return sorted(rows, key=lambda r: r[0])


def _gaps(intervals, min_gap_us: float) -> list[tuple[float, float, dict]]:
    """``(gap start, gap end, the device event that ends it)``: the device timeline's holes (all
    streams merged) longer than ``min_gap_us``."""
    gaps, busy_until = [], None
    for start, end, event in intervals:
        if busy_until is not None and start - busy_until > min_gap_us:
            gaps.append((busy_until, start, event))
        busy_until = end if busy_until is None else max(busy_until, end)
    return gaps


def _op_names(events: list[dict]) -> dict:
    """External id -> ``"op < parent < grandparent"``: the launching host operator and up to two
    host operators around it on the same thread (``aten::mm < CompiledFunctionBackward``)."""
    ops = sorted(((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e)
                  for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op",
                                                                             "user_annotation")),
                 key=lambda r: (r[0], -r[1]))
    names, open_ops = {}, {}  # open_ops: tid -> stack of (end, name) enclosing the current start
    for start, end, e in ops:
        stack = open_ops.setdefault(e.get("tid"), [])
        while stack and stack[-1][0] < end:  # those that ended before this one ends: not enclosing
            stack.pop()
        ext = (e.get("args") or {}).get("External id")
        if ext is not None and e.get("cat") == "cpu_op":
            names[ext] = " < ".join([e.get("name", "?")] + [n for _, n in stack[::-1][:2]])
        stack.append((end, e.get("name", "?")))
    return names


def idle_gaps(trace: dict, steps: int = 1, min_gap_us: float = 20.0) -> dict:
    """Idle device time per step, split by the operator whose launch ended each gap and by the
    synchronisation that preceded it. ``trace``: a loaded Chrome trace of ``steps`` steps."""
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    intervals = _device_intervals(events)
    if not intervals:
        return {"idle_ms_per_step": 0.0, "gaps_per_step": 0.0, "by_launch": [], "after_sync": []}
    names = _op_names(events)
    syncs = sorted((float(e["ts"]) + float(e.get("dur", 0.0)), names.get(
        (e.get("args") or {}).get("External id"), e["name"]))
        for e in events if e.get("cat") == "cuda_runtime" and e.get("name") in SYNC_CALLS)
    by_launch: dict[str, list[float]] = {}
    after_sync: dict[str, list[float]] = {}
    gaps = _gaps(intervals, min_gap_us)
    for start, end, event in gaps:
        ms = (end - start) / 1e3
        op = names.get((event.get("args") or {}).get("External id"), event.get("name", "?"))
        by_launch.setdefault(op[:80], []).append(ms)
        # the synchronisation that returned inside [start - 1 ms, end]: the host waited, then
        # refilled the queue
        sync = next((who for t, who in reversed(syncs) if start - 1e3 <= t <= end), None)
        if sync is not None:
            after_sync.setdefault(sync[:80], []).append(ms)

    def table(groups: dict[str, list[float]]) -> list[dict]:
        rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:TOP]
        return [{"name": k, "idle_ms_per_step": sum(v) / steps, "gaps_per_step": len(v) / steps,
                 "largest_ms": max(v)} for k, v in rows]

    span_ms = (max(r[1] for r in intervals) - intervals[0][0]) / 1e3
    return {"min_gap_us": min_gap_us, "device_span_ms_per_step": span_ms / steps,
            "idle_ms_per_step": sum((e - s) for s, e, _ in gaps) / 1e3 / steps,
            "gaps_per_step": len(gaps) / steps,
            "by_launch": table(by_launch), "after_sync": table(after_sync)}


def format_gaps(g: dict) -> list[str]:
    lines = [f"  idle gaps > {g.get('min_gap_us', 0):.0f} us: {g['idle_ms_per_step']:.1f} ms per "
             f"step in {g['gaps_per_step']:.0f} gaps"]
    for title, rows in (("ended by the launch of", g["by_launch"]),
                        ("after the host synchronised in", g["after_sync"])):
        if rows:
            lines.append(f"    {title}:  idle ms | gaps | largest ms | operator")
            lines += [f"      {r['idle_ms_per_step']:8.2f} | {r['gaps_per_step']:4.0f} | "
                      f"{r['largest_ms']:10.2f} | {r['name']}" for r in rows]
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="trace.json written by logging.profile_at_step")
    p.add_argument("--steps", type=int, default=1, help="steps the trace covers")
    p.add_argument("--min-gap-us", type=float, default=20.0)
    a = p.parse_args(argv)
    try:
        trace = json.loads(a.trace.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: cannot read the trace {a.trace}: {e}") from None
    print("\n".join(format_gaps(idle_gaps(trace, a.steps, a.min_gap_us))))


if __name__ == "__main__":
    main()
