"""``bench/bench_inference.py --real``: a trained teacher/student pair measured at each context
(prefill tokens/s, decode ms/token, peak memory and the student/teacher ratios), with its JSON and
PNG."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from bench.common import print_table, write_result
from bench.inference.timing import GiB, decode_ms, fits, prefill, warm_up
from halo_dist.models.hypenet.modeling_hypenet import HypeNetForCausalLM


def load_real_pair(teacher_dir: str,
                   student_dir: str) -> tuple[HypeNetForCausalLM, HypeNetForCausalLM]:
    """``(teacher, student)`` in fp32 on the CPU: the HF teacher folder (or ``smollm2``) as the
    exact all-attention HypeNet that distillation runs (the HF copy is freed), and the exported
    HypeNet student."""
    from halo_dist.models.convert import load_teacher, load_teacher_config, resolve_teacher
    from halo_dist.models.convert import as_exact_hypenet
    from halo_dist.teacher import teacher_path

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
                                graph=device.type == "cuda")
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

