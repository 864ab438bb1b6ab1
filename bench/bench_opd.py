"""Benchmark: on-policy distillation throughput for the HypeNet-2B shape.

Builds a random Qwen3-1.7B-shaped teacher (28 layers, d 2048, FFN 6144, 16 heads / 8 KV heads, head
dim 128, vocab 151,936, tied) and its HypeNet-2B student (attention layers 2,3,6,8,9,21,25,
Lightning elsewhere), in bf16, and measures on one device:

* rollout tokens/s (after an untimed 4-token rollout of the same batch: compilation, autotuning and
  the first graph capture stay out of the figure): ``sample_rollouts`` (HypeNet's cached batched
  generate, T = 1.0, top-p 1.0, no early EOS so every row runs the full horizon) for ``--rollouts``
  prompts of ``--prompt-len`` tokens and ``--horizon`` new tokens; sampled tokens / wall time;
* training tokens/s: one OPD micro-step on the packed rollouts -- teacher forward (no grad), student
  forward + fused reverse KL + backward, AdamW step -- packed tokens (prompt + continuation) / time,
  and sampled (trained) tokens / time;
* peak memory of each phase.

Random weights make the same FLOPs as trained ones (the sampling distribution changes nothing with
EOS off). Writes JSON (default ``bench/results/opd.json``) and prints a table.

  python bench/bench_opd.py                          # GPU, 2B shape, horizons 512 2048 8192
  python bench/bench_opd.py --horizons 512 --rollouts 16
  python bench/bench_opd.py --cpu-smoke              # tiny shape on CPU (checks the script runs)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import ATTN_2B, RESULTS, SHAPE_2B, SHAPE_TINY, environment, sync  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--horizons", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--rollouts", type=int, default=32,
                   help="rollouts generated together (one rank)")
    p.add_argument("--micro", type=int, default=0,
                   help="rollouts per training micro-step (0: as many as fit --micro-tokens)")
    p.add_argument("--micro-tokens", type=int, default=24576,
                   help="packed tokens per micro-step when --micro is 0 (32 x 768 peaked at 97 GiB "
                        "on an H200)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--chunk-size", type=int, default=None,
                   help="fused-loss token chunk (None: auto)")
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing in the student")
    p.add_argument("--static-decode", action="store_true",
                   help="rollouts through the CUDA-graph StaticDecoder")
    p.add_argument("--continuous", action="store_true",
                   help="rollouts through continuous_rollouts (opd.continuous_batching; one slot "
                        "per rollout here, since every row runs the full horizon)")
    p.add_argument("--compile-layers", action="store_true",
                   help="student and teacher layers compiled for training (model.compile=layer)")
    p.add_argument("--compile-rollouts", action="store_true",
                   help="the static decode step through torch.compile (opd.compile_rollouts)")
    p.add_argument("--state-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the rollout decoder's RNN state dtype (opd.rollout_state_dtype)")
    p.add_argument("--state-write-every", type=int, default=1,
                   help="the rollout decoder writes its Lightning states every n tokens "
                        "(opd.rollout_state_write_every)")
    p.add_argument("--timed-steps", type=int, default=2,
                   help="training steps timed after the warm-up one (the figures are the last "
                        "step's; every step's time and per-micro-batch times are recorded). The "
                        "first timed step can still compile: a frame that first meets the last, "
                        "shorter micro-batch there (4.7 s in that one micro-batch on an H200)")
    p.add_argument("--launch-settings", type=Path, default=None,
                   help="decode-kernel launch settings from bench/tune_decode_kernels.py (its "
                        "'best' entries) instead of the shipped defaults")
    p.add_argument("--skip-train", action="store_true",
                   help="rollouts only (compare rollout paths in one call)")
    p.add_argument("--rollout-phases", action="store_true",
                   help="with --continuous: after the timed rollouts, time their two set-up phases "
                        "alone (the prompts' batched prefill; the decoder's construction with its "
                        "warm-up steps and graph capture) and report the decode loop as the rest")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shape on CPU, fp32")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def build(shape: dict, attn_layers: list[int], device, dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from halo_dist.models.convert import convert_model
    from halo_dist.models.convert import as_exact_hypenet

    torch.manual_seed(0)
    cfg = Qwen3Config(**shape, rope_theta=1_000_000.0, max_position_embeddings=65_536)
    cfg.architectures = ["Qwen3ForCausalLM"]
    with torch.device("cpu"):
        hf = Qwen3ForCausalLM(cfg).eval()
    teacher = as_exact_hypenet(hf).to(device, dtype)
    student = convert_model(hf, attn_layers, attn_logits_scale_base=500.0).to(device, dtype)
    del hf
    return student, teacher


def peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


@torch.no_grad()
def rollout_phases(student, prompts: list[list[int]], horizon: int, options, args,
                   device) -> dict:
    """Seconds of the two phases ``continuous_rollouts`` runs before its decode loop, each timed
    alone the way it runs them (one group, every prompt in a slot): the prompts' batched prefill
    through the eager layers, then the ``StaticDecoder``'s construction (its buffers, packed
    weights, warm-up steps and graph capture; its compiled step is already compiled by the timed
    call, which had the same cache room)."""
    from halo_dist.models.hypenet.modeling_hypenet import eager_decoder_layers
    from halo_dist.models.hypenet.static_decode import StaticDecoder
    from halo_dist.opd.stage import static_options
    from halo_dist.opd.rollouts import prefill_prompts, rollout_room

    room = rollout_room(prompts, horizon, args.compile_rollouts)
    was_training = student.training
    student.eval()
    try:
        with eager_decoder_layers(student):
            sync(device)
            t0 = time.perf_counter()
            cache, mask, _ = prefill_prompts(student, prompts, room, 0)
            sync(device)
            t1 = time.perf_counter()
            decoder = StaticDecoder(student, cache, static_options(args.compile_rollouts, options),
                                    attention_mask=mask)
            sync(device)
            t2 = time.perf_counter()
    finally:
        student.train(was_training)
    del decoder, cache
    return {"prefill_s": t1 - t0, "decoder_s": t2 - t1}


def decoder_options(args):
    """The rollout decoder's ``DecodeOptions`` of ``--state-dtype`` and ``--state-write-every``."""
    from halo_dist.models.hypenet.static_decode import DecodeOptions

    state_dtype = getattr(torch, args.state_dtype)
    return DecodeOptions(state_dtype=None if state_dtype == torch.float32 else state_dtype,
                         state_write_every=args.state_write_every)


def timed_rollouts(student, prompts: list[list[int]], horizon: int, options, args,
                   device) -> tuple[list, float, float | None]:
    """``(continuations, seconds, peak GiB)`` of one timed rollout of every prompt for ``horizon``
    new tokens, after an untimed one of the same batch."""
    from halo_dist.opd.stage import sample_rollouts
    from halo_dist.opd.rollouts import continuous_rollouts

    g = torch.Generator(device=device).manual_seed(horizon)

    def rollout(h: int):
        if args.continuous:
            return continuous_rollouts(student, prompts, h, len(prompts), eos_token_id=None,
                                       generator=g, compile_static=args.compile_rollouts,
                                       decoder_options=options)
        return sample_rollouts(student, prompts, h, eos_token_id=None, generator=g,
                               static_cache=args.static_decode,
                               compile_static=args.compile_rollouts, decoder_options=options)

    # untimed: Triton compilation/autotuning and the first graph capture of this batch shape; a
    # compiled step is compiled per cache room, which the horizon sets: warm it up at the same one
    rollout(horizon if args.compile_rollouts else 4)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    t0 = time.perf_counter()
    gens = rollout(horizon)
    sync(device)
    return gens, time.perf_counter() - t0, peak_gib(device)


def bench_horizon(student, teacher, horizon: int, args, device) -> dict:
    vocab = student.config.vocab_size
    prompts = torch.randint(4, vocab, (args.rollouts, args.prompt_len),
                            generator=torch.Generator().manual_seed(0))
    prompts = prompts.tolist()
    options = decoder_options(args)
    gens, gen_s, gen_mem = timed_rollouts(student, prompts, horizon, options, args, device)
    phases = (rollout_phases(student, prompts, horizon, options, args, device)
              if args.rollout_phases else {})
    sampled = sum(len(x) for x in gens)
    row = {"horizon": horizon, "rollouts": args.rollouts, "prompt_len": args.prompt_len,
           "state_dtype": args.state_dtype, "state_write_every": args.state_write_every,
           "rollout_s": gen_s,
           "rollout_tokens_per_s": sampled / gen_s,
           "rollout_peak_gib": gen_mem}
    if phases:
        loop_s = gen_s - phases["prefill_s"] - phases["decoder_s"]
        row.update(phases, loop_s=loop_s, loop_ms_per_step=loop_s / horizon * 1e3)
    if args.skip_train:
        return row
    return {**row, **timed_training(student, teacher, prompts, gens, horizon, args, device, gen_s)}


def micro_batches(prompts: list[list[int]], gens: list, horizon: int, args, device) -> tuple:
    """``(rollouts per micro-batch, packed micro-batches, sampled tokens)``: ``--micro`` rollouts
    per micro-batch, or as many as fit ``--micro-tokens``."""
    from halo_dist.opd.stage import Rollout, pack_rollouts

    micro = args.micro or max(1,
                              min(args.rollouts, args.micro_tokens // (args.prompt_len + horizon)))
    rollouts = [Rollout(p, c) for p, c in zip(prompts, gens)]
    batches = [pack_rollouts(rollouts[i:i + micro]).to(device)
               for i in range(0, len(rollouts), micro)]
    return micro, batches, sum(b.num_generated for b in batches)


def timed_training(student, teacher, prompts: list[list[int]], gens: list, horizon: int, args,
                   device, rollout_s: float) -> dict:
    """One OPD training step on the packed rollouts, untimed, then ``--timed-steps`` timed ones
    (the figures are the last step's; the OPD rate counts the rollout's ``rollout_s`` too)."""
    from halo_dist.opd.stage import OPDModule, position_buckets

    mod = OPDModule(student, teacher, chunk_size=args.chunk_size,
                    buckets=position_buckets(64, max(horizon, 64)))
    student.train()
    student.model.gradient_checkpointing = args.checkpointing
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")
    micro, batches, n_gen = micro_batches(prompts, gens, horizon, args, device)

    micro_s: list[float] = []  # wall time of each micro-batch of the last step (synchronised)

    def step(opt=opt):  # bound now: opt is deleted after the timing
        micro_s.clear()
        for b in batches:
            t = time.perf_counter()
            loss, *_ = mod(b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen, b.loss_mask,
                           b.gen_index, normalizer=float(n_gen), horizon=horizon)
            loss.backward()
            sync(device)  # one sync per micro-batch: negligible against ~1 s of work each
            micro_s.append(time.perf_counter() - t)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up (allocations, kernels, AdamW state)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps_s, steps_micro = [], []
    for _ in range(max(1, args.timed_steps)):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        steps_s.append(round(time.perf_counter() - t0, 4))
        steps_micro.append([round(t, 4) for t in micro_s])
    train_s, timed_micro = steps_s[-1], steps_micro[-1]
    packed = sum(b.input_ids.shape[1] for b in batches)
    del opt
    student.eval()
    return {"micro": micro, "train_s": train_s, "micro_s": timed_micro,
            "train_steps_s": steps_s, "micro_s_per_step": steps_micro,
            "train_packed_tokens_per_s": packed / train_s,
            "train_sampled_tokens_per_s": n_gen / train_s, "train_peak_gib": peak_gib(device),
            "opd_tokens_per_s": n_gen / (rollout_s + train_s)}


def print_rows(rows: list[dict]) -> None:
    """The table of the horizons (rates in tokens/s), and each timed rollout's phases."""
    print(f"\n{'horizon':>8} {'rollout tok/s':>14} {'train tok/s (packed)':>21} "
          f"{'train tok/s (sampled)':>22} {'OPD tok/s':>10} {'peak GiB':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['horizon']:>8} {r['error']}")
            continue
        if "train_s" not in r:
            print(f"{r['horizon']:>8} {r['rollout_tokens_per_s']:>14.0f} (rollouts only) "
                  f"{r['rollout_peak_gib'] or 0.0:>9.1f}")
            continue
        mem = max(x for x in (r["rollout_peak_gib"], r["train_peak_gib"], 0.0) if x is not None)
        print(f"{r['horizon']:>8} {r['rollout_tokens_per_s']:>14.0f} "
              f"{r['train_packed_tokens_per_s']:>21.0f} {r['train_sampled_tokens_per_s']:>22.0f} "
              f"{r['opd_tokens_per_s']:>10.0f} {mem:>9.1f}")
    for r in rows:
        if "loop_s" in r:
            print(f"h{r['horizon']} rollout {r['rollout_s']:.2f} s = prefill "
                  f"{r['prefill_s']:.2f} + decoder set-up {r['decoder_s']:.2f} + loop "
                  f"{r['loop_s']:.2f} "
                  f"({r['loop_ms_per_step']:.2f} ms per step)")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rollout_phases and not args.continuous:
        print("--rollout-phases times the set-up of continuous rollouts: it needs --continuous",
              file=sys.stderr)
        return 2
    torch.set_num_threads(1 if args.cpu_smoke else torch.get_num_threads())
    if args.cpu_smoke:
        device, dtype, shape, attn = torch.device("cpu"), torch.float32, SHAPE_TINY, [1]
        args.horizons = [h for h in args.horizons if h <= 64] or [16, 32]
        args.rollouts, args.prompt_len = min(args.rollouts, 4), min(args.prompt_len, 16)
        # several micro-steps per step, as at long horizons
        args.micro_tokens = min(args.micro_tokens, 64)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --cpu-smoke", file=sys.stderr)
            return 2
        device, dtype, shape, attn = torch.device("cuda"), torch.bfloat16, SHAPE_2B, ATTN_2B
        from halo_dist.models.fla_offsets import install

        install()  # as the OPD trainer does: fla's packed state passes without a sync per layer
    if args.launch_settings is not None:
        from bench.common import apply_launch_settings

        print(f"launch settings: {apply_launch_settings(args.launch_settings)}", flush=True)
    student, teacher = build(shape, attn, device, dtype)
    if args.compile_layers:
        from halo_dist.models.hypenet.modeling_hypenet import compile_decoder_layers

        compile_decoder_layers(student, "layer")
        compile_decoder_layers(teacher, "layer")
    rows = []
    for h in args.horizons:
        try:
            rows.append(bench_horizon(student, teacher, h, args, device))
        except torch.OutOfMemoryError as e:  # record and go on: the table says where memory ends
            rows.append({"horizon": h, "error": f"OOM: {str(e)[:200]}"})
            torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)
    print_rows(rows)
    out = args.out or (Path("/tmp/halo_dist_opd_smoke.json") if args.cpu_smoke
                       else RESULTS / "opd.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    shape_name = "tiny" if args.cpu_smoke else "hypenet-2b"
    out.write_text(json.dumps({"env": environment(), "shape": shape_name,
                               "model_shape": shape, "attn_layers": attn, "dtype": str(dtype),
                               "args": {k: str(v) for k, v in vars(args).items()},
                               "results": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
