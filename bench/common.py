"""Shared helpers for bench/ scripts: environment facts, CUDA timing, result files, tables."""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"

# Qwen3-1.7B's shape (HF Qwen3Config / HypeNetConfig names) and HypeNet-2B's attention layers (paper
# Table 7), used by every GPU benchmark of the 2B student; a tiny shape for the CPU smoke modes.
SHAPE_2B = dict(num_hidden_layers=28, hidden_size=2048, intermediate_size=6144,
                num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151_936,
                tie_word_embeddings=True)
ATTN_2B = [2, 3, 6, 8, 9, 21, 25]
SHAPE_TINY = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True)


def environment() -> dict:
    """Device, date and library versions recorded with every result."""
    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }
    for name in ("transformers", "fla", "triton", "deepspeed", "flash_attn"):
        try:
            env[name] = __import__(name).__version__
        except Exception:
            env[name] = None
    return env


# Bytes per second a decode step's bytes bound is computed at. The H200's 4.4 TB/s is about 92% of
# its 4.8 TB/s datasheet figure (its split-KV attention has reached ~4.0). The H100 SXM gets its
# whole 3.35 TB/s datasheet figure: its split-KV attention reads 3.22 TB/s at 2M. Another card
# needs --bandwidth.
DECODE_BANDWIDTH = (("H200", 4.4e12), ("H100", 3.35e12))


def decode_bandwidth(override: float | None) -> float:
    """Bytes/s for the bytes bound: ``override`` if given, else this card's entry in
    ``DECODE_BANDWIDTH`` (CPU smoke runs, whose bound means nothing, get the H200's)."""
    if override:
        return override
    if not torch.cuda.is_available():
        return DECODE_BANDWIDTH[0][1]
    name = torch.cuda.get_device_name(0).upper()
    for key, bps in DECODE_BANDWIDTH:
        if key in name:
            return bps
    raise SystemExit(f"no bytes-bound bandwidth known for {name!r}: pass --bandwidth (bytes/s)")


def time_cuda(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def apply_launch_settings(path) -> dict:
    """Install the fastest decode-kernel launch settings that ``bench/tune_decode_kernels.py``
    wrote (its ``best`` entries) into this process's ``decode_attention.LAUNCH`` /
    ``decode_lightning.LAUNCH``: a benchmark times them end to end against the shipped defaults
    before they become the defaults. Returns the settings applied."""
    from halo_dist.models.hypenet import decode_attention, decode_lightning

    payload = json.loads(Path(path).read_text())
    if "best" not in payload:
        raise ValueError(f"{path}: no 'best' entry (not a bench/tune_decode_kernels.py result)")
    for key, cfg in payload["best"].items():
        kernel, entry = key.split("/")
        if kernel == "attention":
            table, name = decode_attention.LAUNCH, entry
        elif kernel == "lightning":
            table, name = decode_lightning.LAUNCH, getattr(torch, entry)
        else:
            raise ValueError(f"{path}: unknown kernel {kernel!r} in 'best'")
        if name not in table or set(cfg) - set(table[name]):
            raise ValueError(f"{path}: 'best' entry {key} {cfg} does not match the table "
                             f"{kernel} {table.get(name)}")
        table[name] = {**table[name], **cfg}
    return payload["best"]


@contextlib.contextmanager
def launch_settings(path):
    """``apply_launch_settings(path)`` inside the block, the previous tables restored after it (an
    A/B of the shipped and the tuned settings in one process)."""
    from halo_dist.models.hypenet import decode_attention, decode_lightning

    saved = [(table, dict(table)) for table in (decode_attention.LAUNCH, decode_lightning.LAUNCH)]
    try:
        yield apply_launch_settings(path)
    finally:
        for table, before in saved:
            table.clear()
            table.update(before)


def no_options(doc: str) -> None:
    """``--help`` (the script's docstring) for a script without options; others are refused."""
    argparse.ArgumentParser(description=doc,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on CPU): bracket every host-timed region."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def write_result(name: str, payload: dict, out: str | None = None) -> Path:
    """Write ``bench/results/<name>.json`` (or ``out``) and, on the device, a copy under $OUT."""
    payload = {**payload, "env": environment()}
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))
    if os.environ.get("OUT") and not str(path).startswith(os.environ["OUT"]):
        Path(os.environ["OUT"], f"{name}.json").write_text(
            json.dumps(payload, indent=2, default=str))
    return path


def print_table(rows: list[dict], title: str = "") -> None:
    if not rows:
        return
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    if title:
        print(f"\n## {title}")
    print("| " + " | ".join(c.ljust(widths[c]) for c in cols) + " |")
    print("|" + "|".join("-" * (widths[c] + 2) for c in cols) + "|")
    for r in rows:
        print("| " + " | ".join(_fmt(r.get(c)).ljust(widths[c]) for c in cols) + " |")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.3f}"
    return str(v)
