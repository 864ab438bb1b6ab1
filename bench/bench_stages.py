"""Benchmark: HALO stages 1, 2 and 3 of HypeNet-2B through the real launchers, and a naive stage-2
step.

Runs ``launchers/stage{1,2,3}.py`` (the product path: typed config, DeepSpeed engine, fused KL,
packed webdataset shards, metrics) with ``configs/bench/stage*_2b.yaml`` -- a random-weight teacher
with Qwen3-1.7B's shape -- chained as a user would: stage 1 writes the aligned RNN layers that stage
2 reads, stage 2's final student starts stage 3 (16K context). Each run's ``metrics.jsonl`` gives
tokens/s, MFU and peak memory (the first logged interval, which holds compilation and autotuning, is
left out).

The naive stage-2 baseline runs in the same process on the same GPU after the launchers: the HF
``Qwen3ForCausalLM`` teacher (SDPA) forward with full logits, the same HypeNet student's forward
with full logits, ``F.kl_div`` on fp32 log-softmaxes, backward, clip, fused AdamW on bf16 weights --
the largest micro-batch that fits of ``--naive-micro``.

MFU counts 6·N_student + 2·N_teacher + attention (PaLM: 12·L·d·T trained, 4·L·d·T forward-only, T =
context) FLOPs per token against 779 TFLOP/s (bf16 matmul measured on the H200).

Writes ``bench/results/stages.json`` with top-level ``stage2_mfu``, ``stage2_speedup_vs_naive``,
``stage3_mfu``.

  python bench/bench_stages.py --data .bench_data/long       # H200: stages 1, 2, 3 + naive
  python bench/bench_stages.py --data D --stages 2 --stage2-micro 32 --no-naive
  python bench/bench_stages.py --data D --nproc 2 --tag dp2  # torchrun on 2 GPUs
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import ATTN_2B, SHAPE_2B, print_table, write_result  # noqa: E402

PEAK = 779e12


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="token shards (manifest folder) for every stage")
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--steps", type=int, nargs=3, default=[15, 20, 6], metavar=("S1", "S2", "S3"))
    p.add_argument("--stage1-micro", type=int, default=32)
    p.add_argument("--stage2-micro", type=int, default=48)
    p.add_argument("--stage2-batch", type=int, default=96)
    p.add_argument("--stage3-micro", type=int, default=1)
    p.add_argument("--stage3-batch", type=int, default=2)
    p.add_argument("--stage3-seq", type=int, default=16384)
    p.add_argument("--checkpointing", choices=("on", "off", "auto"), default="auto",
                   help="activation checkpointing; auto: off, and on again if the run fails (OOM)")
    p.add_argument("--nproc", type=int, default=1, help="GPUs (torchrun) for the launcher runs")
    p.add_argument("--sp", type=int, default=1, help="sequence parallel size for stage 3")
    p.add_argument("--zero", type=int, default=None,
                   help="ZeRO stage override (default: the configs' 1)")
    p.add_argument("--log-every", type=int, default=1,
                   help="1: per-step losses (DP/SP golden comparisons)")
    p.add_argument("--extra", nargs="*", default=[],
                   help="more key=value overrides for every stage")
    p.add_argument("--naive", dest="naive", action="store_true", default=True)
    p.add_argument("--no-naive", dest="naive", action="store_false")
    p.add_argument("--naive-micro", type=int, nargs="+", default=[32, 16, 8, 4])
    p.add_argument("--naive-steps", type=int, default=6)
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench")
    p.add_argument("--tag", default="", help="suffix of the result name (stages_<tag>.json)")
    p.add_argument("--out", default=None,
                   help="result JSON (default bench/results/stages_<tag>.json)")
    p.add_argument("--timeout", type=int, default=420, help="seconds per launcher run")
    p.add_argument("--config-pattern", default="configs/bench/stage{stage}_2b.yaml")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny CPU configs (checks the script end to end)")
    a = p.parse_args(argv)
    if a.cpu_smoke:
        a.config_pattern, a.steps, a.naive = "configs/tiny/stage{stage}.yaml", [4, 4, 4], False
        a.stage1_micro, a.stage2_micro, a.stage2_batch = 2, 2, 4
        a.stage3_micro, a.stage3_batch, a.stage3_seq = 1, 2, 128
        a.log_every, a.checkpointing, a.tag = 1, "off", a.tag or "cpu_smoke"
    return a


# ---------------------------------------------------------------------------------------- launchers
def launcher_cmd(stage: int, nproc: int) -> list[str]:
    script = str(ROOT / "launchers" / f"stage{stage}.py")
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nproc}", script]
    return [sys.executable, script]


def previous_output(a, stage: int) -> Path | None:
    """The final/ folder (with its DONE marker) of this tag's stage run, else of the untagged
    run."""
    for name in (f"stage{stage}{a.tag}", f"stage{stage}"):
        final = a.runs / name / "final"
        if (final / "DONE").exists():
            return final
    return None


def stage_overrides(stage: int, a, run_dir: Path, ckpt: bool) -> list[str]:
    steps = a.steps[stage - 1]
    o = [f"data.train={a.data}", f"schedule.total_steps={steps}",
         f"schedule.warmup_steps={min(5, steps - 1)}", f"logging.run_dir={run_dir}",
         f"logging.log_every={a.log_every}", "checkpoint.every_steps=0",
         # a 2B ZeRO checkpoint is ~28 GB: the device disk fills in 4 runs
         "checkpoint.save_final=false",
         f"model.activation_checkpointing={'true' if ckpt else 'false'}", "data.num_workers=2"]
    if stage == 1:
        o += [f"data.micro_batch_size={a.stage1_micro}",
              f"data.global_batch_size={a.stage1_micro * a.nproc}"]
    if stage == 2:
        o += [f"data.micro_batch_size={a.stage2_micro}", f"data.global_batch_size={a.stage2_batch}"]
        s1 = previous_output(a, 1)
        o.append(f"model.stage1_weights={s1}" if s1 else "model.stage1_weights=null")
    if stage == 3:
        o += [f"data.micro_batch_size={a.stage3_micro}", f"data.global_batch_size={a.stage3_batch}",
              f"data.seq_len={a.stage3_seq}", f"parallel.sp_size={a.sp}"]
        s2 = previous_output(a, 2)
        o.append(f"model.student_init={s2}" if s2 else "model.student_init=null")
    if a.zero is not None:
        o.append(f"parallel.zero_stage={a.zero}")
    return o + vocab_fit(a, stage) + list(a.extra)


def vocab_fit(a, stage: int) -> list[str]:
    """A random teacher that embeds fewer ids than the data's tokenizer has gets the data's
    vocabulary (rounded up to 64): configs/tiny's 4,096-token shape, the CPU rehearsals', on
    .bench_data's Qwen-tokenized shards."""
    from halo_dist.config import load_config
    from halo_dist.data import DataError, load_manifest

    shape = load_config(ROOT / a.config_pattern.format(stage=stage)).model.random_teacher
    try:
        need = int(load_manifest(a.data).tokenizer.get("vocab_size") or 0)
    except DataError:  # bare shards: no tokenizer recorded, the launcher checks the ids
        return []
    if shape is None or need <= shape.vocab_size:
        return []
    return [f"model.random_teacher.vocab_size={-(-need // 64) * 64}"]


def profile_start(a) -> int | None:
    """The first profiled step, when ``--extra`` turns the profiler on
    (``logging.profile_at_step=N``)."""
    for item in a.extra:
        key, _, value = item.partition("=")
        if key == "logging.profile_at_step" and value.strip().isdigit() and int(value) > 0:
            return int(value)
    return None


def summarize_metrics(path: Path, steady: bool = False, before_step: int | None = None) -> dict:
    """Median over the logged intervals after the first (compile/autotune): robust to the one or two
    recompiles that torch.compile (model.compile) makes when a batch's document count first changes.

    ``before_step`` leaves out the profiler's window (steps from it on run under the profiler and
    export its trace). ``steady`` also leaves out warm-up intervals: those slower than 1.5x the
    fastest one. A short benchmark run spends its first two or three steps compiling, which a median
    of five steps does not outvote; a long run amortises that time and is summarised without it."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    logged = [r for r in rows if "perf/tokens_per_s" in r
              and (before_step is None or int(r.get("step", 0)) < before_step)]
    timed = logged[1:] or logged  # first interval: compile/autotune
    if steady and timed:
        fastest = min(r["perf/step_time_s"] for r in timed)
        timed = [r for r in timed if r["perf/step_time_s"] <= 1.5 * fastest]

    def median(key):
        vals = [r[key] for r in timed if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    return {
        "tokens_per_s": median("perf/tokens_per_s"),
        "tokens_per_s_per_gpu": median("perf/tokens_per_s_per_gpu"),
        "mfu": median("perf/mfu"),
        "attended_keys": median("perf/attended_keys"),
        "step_time_s": median("perf/step_time_s"),
        "peak_mem_gib": max((r.get("mem/peak_allocated_gib") or 0) for r in rows) if rows else None,
        "losses": {int(r["step"]): r["train/loss"] for r in rows if "train/loss" in r},
    }


def run_launcher(stage: int, a) -> dict:
    attempts = {"on": [True], "off": [False], "auto": [False, True]}[a.checkpointing]
    for ckpt in attempts:
        run_dir = a.runs / f"stage{stage}{a.tag}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=False)
        cmd = launcher_cmd(stage, a.nproc) + ["--config",
                                              str(ROOT / a.config_pattern.format(stage=stage))]
        cmd += stage_overrides(stage, a, run_dir, ckpt)
        print(f"\n$ {' '.join(cmd)}", flush=True)
        t0 = time.time()
        # streamed, so a run killed by a time limit still shows how far it got
        log = a.runs / f"stage{stage}{a.tag}.log"
        with open(log, "w") as sink:
            try:
                rc = subprocess.run(cmd, cwd=ROOT, timeout=a.timeout, stdout=sink,
                                    stderr=subprocess.STDOUT).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        out = log.read_text(errors="replace")
        wall = time.time() - t0
        lines = [ln for ln in out.splitlines() if "step" in ln and ("loss" in ln or "MFU" in ln)]
        print("\n".join(lines[-8:]) or out[-3000:], flush=True)
        metrics = run_dir / "metrics.jsonl"
        if rc == 0 and metrics.exists():
            return {"stage": stage, "status": "ok", "activation_checkpointing": ckpt,
                    "wall_s": round(wall, 1), "nproc": a.nproc,
                    **summarize_metrics(metrics, steady=True, before_step=profile_start(a))}
        print(f"stage {stage} failed (rc={rc}, checkpointing={ckpt}):\n{out[-2500:]}", flush=True)
    return {"stage": stage, "status": f"failed rc={rc}", "nproc": a.nproc}


# ---------------------------------------------------------------------------------------- naive
QWEN3_1P7B = dict(SHAPE_2B, rope_theta=1e6, max_position_embeddings=40960)


def naive_stage2(a, shape: dict = QWEN3_1P7B, attn_layers=ATTN_2B, device: str = "cuda") -> dict:
    """Plain HF teacher + HypeNet student with materialised logits and torch KL (one GPU)."""
    import torch
    import torch.nn.functional as F
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from halo_dist.models.convert import convert_model
    from halo_dist.models.flops import flops_per_token

    dev = torch.device(device)
    cfg = Qwen3Config(**shape, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(dev):
        teacher = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    student = convert_model(teacher, attn_layers,
                            attn_logits_scale_base=500.0).to(dev, torch.bfloat16).train()
    teacher.requires_grad_(False)
    n_s = sum(p.numel() for p in student.parameters())
    n_t = sum(p.numel() for p in teacher.parameters())
    fpt = flops_per_token(n_s, n_t, attn_layers=len(attn_layers),
                          frozen_attn_layers=cfg.num_hidden_layers,
                          attn_dim=cfg.num_attention_heads * cfg.head_dim, context=512)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=dev.type == "cuda")

    def step(ids):
        with torch.no_grad():
            t_logits = teacher(ids).logits  # [B, T, V] materialised
        s_logits = student(ids).logits  # [B, T, V] materialised
        V = s_logits.shape[-1]
        loss = F.kl_div(F.log_softmax(s_logits.float().view(-1, V), -1),
                        F.log_softmax(t_logits.float().view(-1, V), -1),
                        log_target=True, reduction="batchmean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for micro in a.naive_micro:
        try:
            return naive_rate(step, micro, cfg.vocab_size, a.naive_steps, dev, fpt)
        except torch.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            print(f"naive: micro-batch {micro} does not fit", flush=True)
    return {"status": "oom at every micro-batch"}


def naive_rate(step, micro: int, vocab: int, steps: int, dev, fpt: float) -> dict:
    """Tokens/s, MFU and peak memory of ``steps`` naive steps on one random [micro, 512] batch,
    after two untimed ones."""
    import torch

    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    ids = torch.randint(0, vocab, (micro, 512), device=dev)
    for _ in range(2):
        step(ids)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step(ids)
    sync()
    dt = (time.perf_counter() - t0) / steps
    tok_s = micro * 512 / dt
    return {"status": "ok", "micro_batch": micro, "tokens_per_s": tok_s,
            "mfu": tok_s * fpt / PEAK, "step_time_s": dt,
            "peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30
            if dev.type == "cuda" else None, "loss": float(loss)}


def main(argv=None) -> dict:
    a = parse_args(argv)
    a.data = str(Path(a.data).resolve())
    a.runs.mkdir(parents=True, exist_ok=True)
    results = {}
    for stage in sorted(a.stages):
        results[f"stage{stage}"] = run_launcher(stage, a)
        print_table([{k: v for k, v in results[f"stage{stage}"].items() if k != "losses"}],
                    f"stage {stage}")
        save(a, results)  # after every part: a later timeout loses nothing
    if a.naive and 2 in a.stages and a.nproc == 1:
        results["naive_stage2"] = naive_stage2(a)
        print_table([results["naive_stage2"]],
                    "naive stage 2 (HF teacher + materialised logits + torch KL)")
    return save(a, results, final=True)


def save(a, results: dict, final: bool = False) -> dict:
    s2, s3, nv = (results.get("stage2", {}), results.get("stage3", {}),
                  results.get("naive_stage2", {}))
    payload = {
        "stage2_mfu": s2.get("mfu"),
        "stage2_speedup_vs_naive": (s2["tokens_per_s"] / nv["tokens_per_s"])
        if s2.get("tokens_per_s") and nv.get("tokens_per_s") else None,
        "stage3_mfu": s3.get("mfu"),
        "stage3_peak_mem_gib": s3.get("peak_mem_gib"),
        "peak_flops": PEAK,
        "args": {k: str(v) for k, v in vars(a).items()},
        **results,
    }
    name = f"stages{('_' + a.tag) if a.tag else ''}"
    out = write_result(name, payload,
                       a.out or (f"/tmp/halo_dist_{name}.json" if a.cpu_smoke else None))
    if not final:
        return payload
    print(f"\nstage2 MFU {payload['stage2_mfu']}, speedup vs naive "
          f"{payload['stage2_speedup_vs_naive']}, stage3 MFU {payload['stage3_mfu']}; wrote {out}")
    return payload


if __name__ == "__main__":
    main()
