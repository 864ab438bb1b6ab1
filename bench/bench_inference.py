"""Benchmark: long-context inference, HypeNet-2B vs the Qwen3-1.7B shape.

Both models are built from random bf16 weights with our own code, so the comparison is of the
architectures, not of two code bases: the teacher shape is the exact all-attention HypeNet that
distillation runs (28 softmax layers with RoPE, GQA 16/8, head dim 128), HypeNet-2B keeps attention
in layers 2,3,6,8,9,21,25 (NoPE + logits scaling) and runs Lightning elsewhere. Batch 1.

For each context T:
* prefill: the prompt goes through the model with a KV cache in chunks of ``--chunk`` tokens (each
  chunk is lower-right causal flash attention over the cache so far; Lightning carries its state),
  only the last position's logits are computed. Time = wall time of the whole prefill
  (CUDA-synchronised).
* decode: ``--decode-steps`` single-token forwards on that cache (median ms per token), twice: the
  eager dynamic-cache forward (``decode_eager_ms``), then the static step replayed as a CUDA graph
  (``StaticDecoder``: split-KV Triton attention over the fixed buffers, ``decode_ms``). The graph's
  first logits are compared with the eager step's at the same position (``graph_rel_err``). Where
  the prefill is not run (``--decode-only`` contexts, e.g. 2M), the cache is filled with random
  keys/values and states of the right size: decode time depends on the cache's size, not its values.
* warm-up: a two-chunk prefill and a few decode steps on a short prompt before any timing, so the
  kernels of both chunk kinds (without / with a carried state) are compiled and autotuned untimed.
* memory: a context is first checked to fit (KV cache + one chunk's activations, allocated for
  real); one that does not fit is reported as ``oom`` without spending minutes computing it.

Writes ``bench/results/inference.json`` (top-level ``prefill_speedup_512k``,
``decode_speedup_512k``, ``max_context_tokens``) and ``inference.png``.

``--real TEACHER_DIR STUDENT_DIR`` measures a trained pair instead: the teacher (any
Llama/Qwen-style HF causal LM folder, or ``smollm2``) re-expressed as the exact all-attention
HypeNet, so both sides run the same kernels and caches, and the student (an exported HypeNet
folder). Real weights, random token ids (the same ids for both models; speed does not depend on the
text). Per context, in one run: prefill tokens/s, decode ms/token (CUDA graph on CUDA, eager
elsewhere), peak memory, and student/teacher ratios. Writes ``bench/results/inference_real.json``
and ``inference_real.png``.

  python bench/bench_inference.py                                   # H200: 32K..1M, 2M decode
  python bench/bench_inference.py --contexts 32768 131072 --teacher-contexts 32768 131072
  python bench/bench_inference.py --contexts --decode-only 524288 2097152 \\
      --teacher-decode-only 524288                                  # decode only
  python bench/bench_inference.py --cpu-smoke                       # tiny shapes on CPU
  python bench/bench_inference.py --real smollm2 out/smol-hypenet   # real pair, 8K..128K
  # real pair, 64/128 tokens on CPU
  python bench/bench_inference.py --real TEACHER STUDENT --cpu-smoke
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import (ATTN_2B, RESULTS, SHAPE_2B, SHAPE_TINY, print_table,  # noqa: E402
                          write_result)
from halo_dist.models.hypenet.configuration_hypenet import HypeNetConfig  # noqa: E402
from halo_dist.models.hypenet.cache_hypenet import HypeNetCache  # noqa: E402
from halo_dist.models.hypenet.modeling_hypenet import HypeNetForCausalLM  # noqa: E402
from halo_dist.models.hypenet.static_decode import StaticDecoder  # noqa: E402

GiB = 1 << 30
REAL_CONTEXTS = [8192, 16384, 32768, 65536, 131072]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--real", nargs=2, metavar=("TEACHER_DIR", "STUDENT_DIR"),
                   help="measure this trained pair (HF teacher folder or 'smollm2', exported "
                        "HypeNet student)")
    p.add_argument("--contexts", type=int, nargs="*", default=None,
                   help="contexts where HypeNet prefills (and decodes); default 32K..1M, with "
                        "--real 8K..128K")
    p.add_argument("--teacher-contexts", type=int, nargs="+", default=None,
                   help="contexts where the teacher shape prefills (default 32K, 128K, 512K); at "
                        "the other --contexts it is only fit-checked")
    p.add_argument("--decode-only", type=int, nargs="*", default=None,
                   help="contexts where HypeNet decodes on a random cache of that size, no prefill "
                        "(default 2M)")
    p.add_argument("--teacher-decode-only", type=int, nargs="*", default=None,
                   help="--decode-only contexts where the teacher shape decodes too (default: fit "
                        "check only)")
    p.add_argument("--chunk", type=int, default=131072, help="prefill chunk (tokens)")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--no-graph", action="store_true", help="time only the eager decode")
    p.add_argument("--compile-decode", action="store_true",
                   help="also time the graph of the torch.compile'd step (decode_compiled_ms; the "
                        "headline decode_ms takes it when it compiled)")
    p.add_argument("--profile", action="store_true",
                   help="print the top CUDA kernels of one 2-chunk prefill (2 x 32K) and one "
                        "decode step per model")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.real:
        return _real_args(p, a)
    a.contexts = [32768, 131072, 524288, 1048576] if a.contexts is None else a.contexts
    a.teacher_contexts = ([32768, 131072, 524288] if a.teacher_contexts is None
                          else a.teacher_contexts)
    a.decode_only = [2097152] if a.decode_only is None else a.decode_only
    a.teacher_decode_only = a.teacher_decode_only or []
    if a.cpu_smoke:
        a.contexts, a.teacher_contexts, a.decode_only, a.chunk, a.decode_steps = ([64, 128], [64],
                                                                                  [256], 48, 3)
        a.out = a.out or Path("/tmp/halo_dist_inference_smoke.json")
    return a


def _real_args(p, a):
    """--real prefills and decodes both models at every --contexts: the shape-mode options do not
    apply."""
    unused = [flag for flag, v in (("--teacher-contexts", a.teacher_contexts),
                                   ("--decode-only", a.decode_only),
                                   ("--teacher-decode-only", a.teacher_decode_only),
                                   ("--profile", a.profile),
                                   ("--compile-decode", a.compile_decode)) if v]
    if unused:
        p.error(f"{', '.join(unused)} do not apply with --real (both models run at every "
                "--contexts)")
    if a.cpu_smoke:
        a.contexts, a.chunk, a.decode_steps = a.contexts or [64, 128], 48, 3
        a.out = a.out or Path("/tmp/halo_dist_inference_real_smoke.json")
    a.contexts = a.contexts or list(REAL_CONTEXTS)
    if min(a.contexts) < 2:
        p.error("--contexts must be >= 2 tokens")
    return a


def model_configs(smoke: bool) -> dict[str, HypeNetConfig]:
    shape, attn = (SHAPE_TINY, [1]) if smoke else (SHAPE_2B, ATTN_2B)
    L = shape["num_hidden_layers"]
    teacher = HypeNetConfig(**shape, mixer_types=["attention"] * L, attn_rope=True,
                            attn_logits_scale_base=None, attn_output_gate=False, rope_theta=1e6)
    student = HypeNetConfig(
        **shape, mixer_types=["attention" if i in attn else "lightning" for i in range(L)],
        attn_rope=False, attn_logits_scale_base=500.0, rope_theta=1e6)
    return {"qwen3-1.7b-shape": teacher, "hypenet-2b": student}


def build(cfg: HypeNetConfig, device, dtype) -> HypeNetForCausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        model = HypeNetForCausalLM(cfg)
    return model.to(dtype).eval()


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kv_bytes(cfg: HypeNetConfig, T: int, itemsize: int) -> int:
    attn = sum(m == "attention" for m in cfg.mixer_types)
    return 2 * attn * T * cfg.num_key_value_heads * cfg.head_dim * itemsize


def activation_bytes(cfg: HypeNetConfig, chunk: int, itemsize: int) -> int:
    """Rough peak of one chunk's transient tensors: the MLP's gate/up/act (3 x F) plus q/k/v/o and
    the residual stream (~8 x d), plus a repeated copy of the cache's keys/values for GQA (bounded
    by the attention call) -- an estimate used only to skip contexts that cannot fit."""
    return chunk * (3 * cfg.intermediate_size + 8 * cfg.hidden_size) * itemsize


def fits(cfg, T, chunk, device, itemsize) -> tuple[bool, float]:
    """Allocate (for real) the cache plus one chunk's activations; True if that succeeds."""
    need = kv_bytes(cfg, T, itemsize) + activation_bytes(cfg, min(chunk, T), itemsize)
    if device.type != "cuda":
        return True, need / GiB
    try:
        block = torch.empty(need, dtype=torch.uint8, device=device)
        del block
        return True, need / GiB
    except torch.OutOfMemoryError:
        return False, need / GiB
    finally:
        torch.cuda.empty_cache()


@torch.inference_mode()
def prefill(model, T: int, chunk: int, device, decode_room: int,
            ids: torch.Tensor | None = None) -> tuple[float, HypeNetCache, torch.Tensor, list]:
    """Chunked prefill of T tokens (``ids`` [1, T] on ``device``, random when None):
    ``(seconds, cache, greedy next token, seconds per chunk)``."""
    cache = HypeNetCache(model.config.num_hidden_layers, reserve_tokens=decode_room)
    if ids is None:
        ids = torch.randint(0, model.config.vocab_size, (1, T), device=device)
    sync(device)
    t0 = time.perf_counter()
    marks = [t0]
    for start in range(0, T, chunk):
        out = model(ids[:, start:start + chunk], cache=cache, use_cache=True, logits_to_keep=1)
        sync(device)
        marks.append(time.perf_counter())
    chunk_s = [round(b - a, 3) for a, b in zip(marks[:-1], marks[1:])]
    return marks[-1] - t0, out.cache, out.logits[:, -1].argmax(-1), chunk_s


@torch.inference_mode()
def random_cache(model, T: int, device, dtype, decode_room: int) -> HypeNetCache:
    """A cache of T tokens with random contents (decode cost depends on size, not values)."""
    cfg = model.config
    cache = HypeNetCache(cfg.num_hidden_layers, reserve_tokens=decode_room)
    for i, kind in enumerate(cfg.mixer_types):
        if kind == "attention":
            k = torch.randn(1, T, cfg.num_key_value_heads, cfg.head_dim, device=device, dtype=dtype)
            cache.append_kv(i, k, k)
        else:
            H, D = cfg.num_attention_heads, cfg.head_dim
            cache.layers[i] = torch.randn(1, H, D, D, device=device, dtype=torch.float32) * 0.01
    cache.seen_tokens = T
    return cache


def rnn_states(cache: HypeNetCache) -> list:
    return [e for e in cache.layers if e is not None and not isinstance(e, tuple)]


def rewind(cache: HypeNetCache, T: int, states: list) -> None:
    """Put a cache back to T tokens: attention views shortened, RNN states restored from copies."""
    for i, entry in enumerate(cache.layers):
        if isinstance(entry, tuple):
            cache.layers[i] = (entry[0][:, :T], entry[1][:, :T])
    for live, saved in zip(rnn_states(cache), states):
        live.copy_(saved)
    cache.seen_tokens = T


def timed_steps(step, token: torch.Tensor, steps: int, device) -> tuple[float, torch.Tensor]:
    """Median ms per token of ``steps`` greedy steps (``step(tokens [1]) -> logits [1, V]``); the
    first step's logits come back for the graph-vs-eager check."""
    times, nxt, first = [], token.view(1), None
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        logits = step(nxt)
        nxt = logits.argmax(-1)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        first = logits.float().clone() if first is None else first
    times = sorted(times[1:] if len(times) > 2 else times)  # the first step may grow buffers
    return times[len(times) // 2], first


@torch.inference_mode()
def decode_ms(model, cache: HypeNetCache, token: torch.Tensor, steps: int, device,
              graph: bool = True, compiled: bool = False) -> dict:
    """Eager dynamic-cache decode, then (``graph``) the static CUDA-graph decode from the same
    position, then (``compiled``) the graph of the torch.compile'd static step from there again."""
    T, saved = cache.seen_tokens, [s.clone() for s in rnn_states(cache)]

    def eager(nxt):
        return model(nxt.view(1, 1), cache=cache, use_cache=True).logits[:, -1]

    out = {}
    out["decode_eager_ms"], first_eager = timed_steps(eager, token, steps, device)
    if not graph:
        return out
    rewind(cache, T, saved)
    dec = StaticDecoder(model, cache)
    out["decode_graph_ms"], first_graph = timed_steps(dec.step, token, steps, device)
    out["graph"] = dec.graph is not None if device.type == "cuda" else "cpu (eager static step)"
    if dec.graph_error:
        out["graph_error"] = dec.graph_error
    out["graph_rel_err"] = float((first_graph - first_eager).norm() / first_eager.norm())
    if not compiled:
        return out
    del dec
    rewind(cache, T, saved)
    t0 = time.perf_counter()
    dec = StaticDecoder(model, cache, compile=True)  # compiles and captures
    out["compile_s"] = round(time.perf_counter() - t0, 1)
    out["decode_compiled_ms"], first_compiled = timed_steps(dec.step, token, steps, device)
    out["compiled"] = dec.compiled and (dec.graph is not None or device.type != "cuda")
    if dec.compile_error or dec.graph_error:
        out["compile_error"] = dec.compile_error or dec.graph_error
    out["compiled_rel_err_vs_graph"] = float((first_compiled - first_graph).norm()
                                             / first_graph.norm())
    out["compiled_rel_err_vs_eager"] = float((first_compiled - first_eager).norm()
                                             / first_eager.norm())
    return out


def warm_up(model, chunk: int, device, graph: bool) -> None:
    """Kernel compilation / autotune, untimed, on a short prompt in two chunks: the second carries
    the RNN state and attends lower-right causally over the cache, as every later chunk does."""
    w = min(chunk, 4096)
    _, cache, last, _ = prefill(model, 2 * w, w, device, 8)
    decode_ms(model, cache, last, 3, device, graph=graph)


def run_one(name, model, T, args, device, dtype, *, do_prefill: bool) -> dict:
    cfg, itemsize = model.config, torch.finfo(dtype).bits // 8
    ok, need = fits(cfg, T, args.chunk, device, itemsize)
    row = {"model": name, "context": T, "prefill_s": None, "decode_ms": None,
           "decode_eager_ms": None, "est_GiB": round(need, 1), "peak_GiB": None, "status": "ok"}
    if not ok:
        row["status"] = "oom"
        return row
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        # eager steps, then (rewound) graph warm-up + steps, compiled likewise
        room = args.decode_steps + 4
        if do_prefill:
            row["prefill_s"], cache, last, row["prefill_chunk_s"] = prefill(model, T, args.chunk,
                                                                            device, room)
        else:
            cache, last = (random_cache(model, T, device, dtype, room),
                           torch.zeros(1, dtype=torch.long, device=device))
            row["status"] = "decode-only"
        row.update(decode_ms(model, cache, last, args.decode_steps, device, graph=not args.no_graph,
                             compiled=args.compile_decode and not args.no_graph))
        row["decode_ms"] = (row["decode_compiled_ms"] if row.get("compiled")
                            else row.get("decode_graph_ms", row["decode_eager_ms"]))
        del cache
    except torch.OutOfMemoryError:
        row["status"] = "oom"
    if device.type == "cuda":
        row["peak_GiB"] = round(torch.cuda.max_memory_allocated(device) / GiB, 1)
        torch.cuda.empty_cache()
    return row


def headline(rows: list[dict], T: int) -> dict:
    by = {(r["model"], r["context"]): r for r in rows}
    t, s = by.get(("qwen3-1.7b-shape", T)), by.get(("hypenet-2b", T))
    out = {}
    if t and s and t["prefill_s"] and s["prefill_s"]:
        out["prefill"] = t["prefill_s"] / s["prefill_s"]
    if t and s and t["decode_ms"] and s["decode_ms"]:
        out["decode"] = t["decode_ms"] / s["decode_ms"]
    if t and s and t.get("decode_eager_ms") and s.get("decode_eager_ms"):
        out["decode_eager"] = t["decode_eager_ms"] / s["decode_eager_ms"]
    return out


def profile(model, device, chunk: int = 32768) -> None:
    """Top CUDA kernels of one two-chunk prefill (the second chunk carries state), one eager decode
    step and the static decode step (the kernels a CUDA graph replays). The static step's summed
    kernel time against the graph's wall time per token splits the fixed decode cost into kernel
    work and launch gaps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    with torch_profile(activities=acts) as prof:
        _, cache, last, _ = prefill(model, 2 * chunk, chunk, device, 8)
    print(f"--- profile: prefill 2 x {chunk} ---\n"
          + prof.key_averages().table(sort_by=sort, row_limit=15))
    with torch_profile(activities=acts) as prof, torch.inference_mode():
        model(last.view(1, 1), cache=cache, use_cache=True)
        sync(device)
    print("--- profile: one eager decode step ---\n"
          + prof.key_averages().table(sort_by=sort, row_limit=15))
    dec = StaticDecoder(model, cache, use_cuda_graph=False)
    nxt = last.view(1)
    dec.step(nxt)  # first static step (Triton compile) untimed
    steps = 3
    with torch_profile(activities=acts) as prof:
        for _ in range(steps):
            nxt = dec.step(nxt).argmax(-1)
        sync(device)
    events = prof.key_averages()
    print(f"--- profile: {steps} static decode steps (the graph's kernels) ---\n"
          + events.table(sort_by=sort, row_limit=20))
    if device.type == "cuda":
        cuda = torch.autograd.DeviceType.CUDA
        kernel_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
                        for e in events if getattr(e, "device_type", None) == cuda)
        print(f"static step: {kernel_us / steps / 1e3:.3f} ms of CUDA kernel time per token "
              f"(compare decode_graph_ms at this context)")


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("qwen3-1.7b-shape", "hypenet-2b"):
        mine = [r for r in rows if r["model"] == name]
        pre = [(r["context"], r["prefill_s"]) for r in mine if r["prefill_s"]]
        dec = [(r["context"], r["decode_ms"]) for r in mine if r["decode_ms"]]
        if pre:
            axes[0].plot(*zip(*pre), marker="o", label=name)
        if dec:
            axes[1].plot(*zip(*dec), marker="o", label=name)
        for r in mine:
            if r["status"] == "oom":
                axes[1].axvline(r["context"], ls=":", color="gray")
                axes[1].text(r["context"], axes[1].get_ylim()[1] * 0.9, f"{name}\nOOM", fontsize=7)
    for ax, title, unit in ((axes[0], "prefill", "s"), (axes[1], "decode", "ms / token")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(unit)
        ax.set_title(f"{title}, batch 1, bf16")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------------------------------------
# --real: a trained teacher/student pair
# ------------------------------------------------------------------------------------------------


def load_real_pair(teacher_dir: str,
                   student_dir: str) -> tuple[HypeNetForCausalLM, HypeNetForCausalLM]:
    """``(teacher, student)`` in fp32 on the CPU: the HF teacher folder (or ``smollm2``) as the
    exact all-attention HypeNet that distillation runs (the HF copy is freed), and the exported
    HypeNet student."""
    from halo_dist.models.convert import load_teacher, load_teacher_config, resolve_teacher
    from halo_dist.models.convert import as_exact_hypenet
    from halo_dist.stages.teacher import teacher_path

    source = resolve_teacher(teacher_path(str(teacher_dir)))
    load_teacher_config(source)  # fails fast on a bad path / architecture
    hf = load_teacher(source, torch.float32)
    teacher = as_exact_hypenet(hf)
    del hf
    student = HypeNetForCausalLM.from_pretrained(str(student_dir), dtype=torch.float32).eval()
    return teacher, student


def measure_context(model: HypeNetForCausalLM, ids: torch.Tensor, chunk: int, decode_steps: int,
                    device, graph: bool) -> dict:
    """One model at one context: chunked prefill of ``ids`` [1, T], then ``decode_steps`` greedy
    steps.

    ``decode_ms`` is the CUDA-graph step when ``graph`` (else the eager step). ``peak_GiB`` (CUDA
    only) is the model's weights plus the most memory allocated above what was resident before, i.e.
    what the model would peak at alone on the device even though the other model of the pair stays
    loaded.
    """
    T, itemsize = ids.shape[1], next(model.parameters()).element_size()
    ok, need = fits(model.config, T, chunk, device, itemsize)
    row = {"prefill_s": None, "prefill_tok_s": None, "decode_ms": None, "decode_eager_ms": None,
           "peak_GiB": None, "est_GiB": round(need, 2), "status": "ok" if ok else "oom"}
    if not ok:
        return row
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device)
    try:
        row["prefill_s"], cache, last, row["prefill_chunk_s"] = prefill(model, T, chunk, device,
                                                                        decode_steps + 4, ids)
        row["prefill_tok_s"] = T / row["prefill_s"]
        row.update(decode_ms(model, cache, last, decode_steps, device, graph=graph))
        row["decode_ms"] = row.get("decode_graph_ms", row["decode_eager_ms"])
        del cache
    except torch.OutOfMemoryError:
        row["status"] = "oom"
    if device.type == "cuda":
        row["peak_GiB"] = (weights + torch.cuda.max_memory_allocated(device) - resident) / GiB
        torch.cuda.empty_cache()
    return row


def _ratio(student, teacher):
    return student / teacher if student and teacher else None


def pair_row(T: int, teacher: dict, student: dict) -> dict:
    """The table row of one context; every ``*_ratio`` is student / teacher of that quantity
    (prefill tokens/s above 1, decode ms and memory below 1 mean the student is better)."""
    status = "ok" if teacher["status"] == student["status"] == "ok" else \
        f"teacher {teacher['status']}, student {student['status']}"
    return {
        "context": T, "status": status,
        "teacher_prefill_s": teacher["prefill_s"], "student_prefill_s": student["prefill_s"],
        "teacher_prefill_tok_s": teacher["prefill_tok_s"],
        "student_prefill_tok_s": student["prefill_tok_s"],
        "prefill_tok_s_ratio": _ratio(student["prefill_tok_s"], teacher["prefill_tok_s"]),
        "teacher_decode_ms": teacher["decode_ms"], "student_decode_ms": student["decode_ms"],
        "decode_ms_ratio": _ratio(student["decode_ms"], teacher["decode_ms"]),
        "teacher_peak_GiB": teacher["peak_GiB"], "student_peak_GiB": student["peak_GiB"],
        "peak_GiB_ratio": _ratio(student["peak_GiB"], teacher["peak_GiB"]),
    }


def describe_model(model: HypeNetForCausalLM) -> dict:
    cfg = model.config
    return {"params": sum(p.numel() for p in model.parameters()), "layers": cfg.num_hidden_layers,
            "attention_layers": [i for i, m in enumerate(cfg.mixer_types) if m == "attention"],
            "mixers": sorted(set(cfg.mixer_types)), "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size}


def measure_real_pair(teacher_model: HypeNetForCausalLM, student_model: HypeNetForCausalLM,
                      contexts: list[int], device, dtype, *, chunk: int = 131072,
                      decode_steps: int = 16, graph: bool | None = None,
                      warmup: bool = True) -> dict:
    """Prefill and decode speed of a teacher/student pair at each of ``contexts`` (tokens), batch 1.

    Both models are moved to ``device`` / ``dtype`` and stay loaded; at each context they see the
    same random token ids (seeded by the context). ``graph``: decode through CUDA graphs (default:
    on CUDA only).
    Returns ``{"rows": [pair_row per context], "detail": {context: {"teacher": ..., "student":
    ...}}, ...}``.
    """
    device = torch.device(device)
    graph = device.type == "cuda" if graph is None else graph
    models = {"teacher": teacher_model.to(device=device, dtype=dtype).eval(),
              "student": student_model.to(device=device, dtype=dtype).eval()}
    vocab = min(m.config.vocab_size for m in models.values())
    if warmup:
        for model in models.values():
            warm_up(model, chunk, device, graph)
    rows, detail = [], {}
    for T in contexts:
        ids = torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(T)).to(device)
        detail[T] = {who: measure_context(m, ids, chunk, decode_steps, device, graph)
                     for who, m in models.items()}
        rows.append(pair_row(T, detail[T]["teacher"], detail[T]["student"]))
        print_table([rows[-1]])
    return {"rows": rows, "detail": detail, "contexts": list(contexts),
            "chunk": chunk, "decode_steps": decode_steps,
            "decode": "cuda graph" if graph and device.type == "cuda" else "eager",
            "device": str(device), "dtype": str(dtype).replace("torch.", ""), "batch": 1,
            "input": "random token ids, the same for both models (real weights; speed does "
                     "not depend on the text)", "teacher": describe_model(models["teacher"]),
            "student": describe_model(models["student"])}


def plot_real(rows: list[dict], path: Path, title: str = "") -> None:
    """Prefill tokens/s, decode ms/token and peak memory against context, teacher and student."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return
    panels = (("prefill_tok_s", "prefill", "tokens / s"), ("decode_ms", "decode", "ms / token"),
              ("peak_GiB", "peak memory", "GiB"))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (key, name, unit) in zip(axes, panels):
        for who in ("teacher", "student"):
            pts = [(r["context"], r[f"{who}_{key}"]) for r in rows if r[f"{who}_{key}"]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=who)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(unit)
        ax.set_title(f"{name}, batch 1")
        if not ax.lines:  # peak memory is measured on CUDA only
            ax.text(0.5, 0.5, "not measured", ha="center", transform=ax.transAxes)
            continue
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.legend()
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_real(args, device, dtype) -> dict:
    """``--real TEACHER STUDENT``: load the pair, measure, write JSON + PNG, print the table."""
    teacher, student = load_real_pair(*args.real)
    payload = measure_real_pair(teacher, student, args.contexts, device, dtype, chunk=args.chunk,
                                decode_steps=args.decode_steps,
                                graph=device.type == "cuda" and not args.no_graph)
    payload.update(teacher_dir=str(args.real[0]), student_dir=str(args.real[1]))
    print_table(payload["rows"],
                f"real pair, batch 1, {payload['dtype']}, decode: {payload['decode']}")
    out = write_result("inference_real", payload, str(args.out) if args.out else None)
    title = (f"{Path(args.real[0]).name} vs {Path(args.real[1]).name} "
             f"({payload['dtype']}, random ids)")
    plot_real(payload["rows"], out.with_suffix(".png"), title)
    if os.environ.get("OUT"):
        plot_real(payload["rows"], Path(os.environ["OUT"]) / "inference_real.png", title)
    print(f"wrote {out}")
    return payload


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.real:
        return run_real(args, device, dtype)
    rows = []
    for name, cfg in model_configs(args.cpu_smoke).items():
        model = build(cfg, device, dtype)
        warm_up(model, args.chunk, device, graph=not args.no_graph)
        if args.profile:
            profile(model, device, chunk=64 if args.cpu_smoke else 32768)
        # the teacher only fit-checks decode-only ones
        contexts = list(args.contexts) + list(args.decode_only)
        for T in contexts:
            runs_here = (T in args.teacher_decode_only if T in args.decode_only
                         else T in args.teacher_contexts)
            teacher_skip = name != "hypenet-2b" and not runs_here
            if teacher_skip:  # only check whether it would fit
                ok, need = fits(cfg, T, args.chunk, device, torch.finfo(dtype).bits // 8)
                row = {"model": name, "context": T, "prefill_s": None,
                       "decode_ms": None, "est_GiB": round(need, 1), "peak_GiB": None,
                       "status": "fits (not run)" if ok else "oom"}
            else:
                row = run_one(name, model, T, args, device, dtype,
                              do_prefill=T not in args.decode_only)
            rows.append(row)
            print_table([row])
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(rows, "inference, batch 1")
    hd = headline(rows, 524288)
    ran = [r["context"] for r in rows
           if r["model"] == "hypenet-2b" and r["status"] in ("ok", "decode-only")]
    payload = {
        "prefill_speedup_512k": hd.get("prefill"),
        "decode_speedup_512k": hd.get("decode"),
        "max_context_tokens": max(ran) if ran else None,
        "decode_eager_speedup_512k": hd.get("decode_eager"),
        "speedups": {T: headline(rows, T) for T in sorted({r["context"] for r in rows})},
        "chunk": args.chunk,
        "rows": rows,
    }
    out = write_result("inference", payload, str(args.out) if args.out else None)
    png = (args.out or RESULTS / "inference.json").with_suffix(".png")
    plot(rows, png)
    if os.environ.get("OUT"):
        plot(rows, Path(os.environ["OUT"]) / "inference.png")
    print(f"\nprefill speedup @512K {hd.get('prefill')}, decode speedup @512K {hd.get('decode')}; "
          f"wrote {out}")
    return payload


if __name__ == "__main__":
    main()
