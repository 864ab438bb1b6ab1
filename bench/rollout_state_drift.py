"""How far a bf16 rollout state moves the student's next-token distribution
(``opd.rollout_state_dtype``).

A batched OPD rollout step reads and writes every row's Lightning state (1 MB per row and layer in
fp32 at the 2B shape: about half the step's bytes at 256 rollouts), so keeping it in bf16 would cut
the step's time by about a fifth. The price is one bf16 rounding of the state per token. Rollouts
are only *sampled* from it (the training forward recomputes every log-probability in fp32), so
what matters is how far the sampling distribution drifts from the fp32-state one.

Two ``StaticDecoder``s run on copies of one prefilled cache, RNN states in fp32 (the reference) and
in bf16. Tokens are sampled from the fp32 decoder (temperature 1) and fed to both (teacher
forcing), so both see the same text; per step the script records KL(p_fp32 || p_bf16), the total
variation distance and whether the two argmaxes agree, and prints them by position bucket. A
control row says how sensitive the model is at all: fp32 states, perturbed once after the prefill
by a relative 1e-3 (about one bf16 rounding), against the unperturbed ones.

Models:
* ``--student DIR``: a HypeNet folder (a stage's ``final/`` or an export), with its tokenizer if the
  folder has one (else the bundled Qwen tokenizer), prompts from the bundled wiki text: measure your
  own distilled student before turning the option on.
* ``--model smollm2`` (CPU default): the bundled SmolLM2-135M-Instruct converted to HypeNet
  (``--attn-layers`` kept, the other layers Lightning; HALO's conversion, no distillation), fp32
  weights, prompts from the bundled wiki text. Real embeddings and projections, so the states'
  magnitudes are those of real text; an undistilled student's outputs are not a good model's.
* ``--model 2b-random`` (GPU): the HypeNet-2B shape with random bf16 weights (``bench_opd.build``),
  random prompts: the bytes and kernels of the product's rollouts, not their statistics.

  .venv/bin/python bench/rollout_state_drift.py                       # CPU, ~2 min
  python3 bench/rollout_state_drift.py --student runs/hypenet-2b/stage3/final
  python3 bench/rollout_state_drift.py --model 2b-random --rows 64 --tokens 2048
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import RESULTS, environment, print_table  # noqa: E402
from halo_dist.models.hypenet import HypeNetCache  # noqa: E402
from halo_dist.models.hypenet.static_decode import DecodeOptions, StaticDecoder  # noqa: E402

SMOLLM2_ATTN = [1, 5, 9, 13, 17, 21, 25, 29]  # 8 of 30 layers, about HypeNet-2B's share (7 of 28)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("smollm2", "2b-random"), default="smollm2")
    p.add_argument("--student", type=Path, default=None,
                   help="a HypeNet folder (overrides --model)")
    p.add_argument("--attn-layers", type=int, nargs="+", default=SMOLLM2_ATTN)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--state-mantissa", type=int, default=None, metavar="BITS",
                   help="instead of a bf16 state, round every fp32 state to BITS explicit "
                        "mantissa bits after each token (round to nearest): 15 is a 24-bit "
                        "state (bf16 + one more byte: 3/4 of fp32's bytes), 7 is bf16's")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.state_mantissa is not None and not 1 <= a.state_mantissa <= 22:
        p.error("--state-mantissa: 1 to 22 bits (fp32 has 23)")
    return a


def smollm2_student(attn_layers: list[int]):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from halo_dist.teacher import smollm2_teacher_dir
    from halo_dist.models.convert import convert_model

    folder = smollm2_teacher_dir()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return convert_model(hf, attn_layers).eval(), AutoTokenizer.from_pretrained(folder)


def wiki_prompts(tokenizer, rows: int, length: int) -> torch.Tensor:
    """``[rows, length]`` token ids: the first ``length`` tokens of the first long-enough
    documents."""
    from halo_dist.assets.text import iter_wiki_texts

    out = []
    for text in iter_wiki_texts():
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == rows:
            return torch.tensor(out)
    raise SystemExit(f"only {len(out)} wiki documents have {length} tokens")


def folder_student(folder: Path, device):
    from transformers import AutoTokenizer

    from halo_dist.assets.tokenizer import load_qwen_tokenizer
    from halo_dist.models.hypenet import HypeNetForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = HypeNetForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    has_tok = (folder / "tokenizer_config.json").exists()
    return model, AutoTokenizer.from_pretrained(folder) if has_tok else load_qwen_tokenizer()


def build(args):
    if args.student is not None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model, tok = folder_student(args.student, device)
        return model, wiki_prompts(tok, args.rows, args.prompt_len), device
    if args.model == "smollm2":
        model, tok = smollm2_student(args.attn_layers)
        return model, wiki_prompts(tok, args.rows, args.prompt_len), torch.device("cpu")
    from bench.bench_opd import build as build_2b
    from bench.common import ATTN_2B, SHAPE_2B

    device = torch.device("cuda")
    model, _ = build_2b(SHAPE_2B, ATTN_2B, device, torch.bfloat16)
    g = torch.Generator().manual_seed(args.seed)
    return model.eval(), torch.randint(4, SHAPE_2B["vocab_size"], (args.rows, args.prompt_len),
                                       generator=g), device


BUCKETS = [(0, 16), (16, 64), (64, 256), (256, 1024), (1024, 4096), (4096, 1 << 30)]


def round_mantissa(decoder: StaticDecoder, bits: int) -> None:
    """Round every fp32 RNN state to ``bits`` explicit mantissa bits in place, to nearest (ties
    away from zero): add half of the dropped part to the bit pattern, then clear it (a carry into
    the exponent is the correct rounding up)."""
    drop = 23 - bits
    for s in decoder.cache.rnn_states():
        s.view(torch.int32).add_(1 << (drop - 1)).bitwise_and_(~((1 << drop) - 1))


@torch.inference_mode()
def drift(model, prompts: torch.Tensor, tokens: int, device, seed: int,
          state_dtype: torch.dtype | None = torch.bfloat16, perturb: float = 0.0,
          mantissa: int | None = None) -> dict:
    """Per-step KL, total variation and argmax agreement of the second decoder (RNN states in
    ``state_dtype``, or fp32 perturbed once by a relative ``perturb``, or fp32 rounded to
    ``mantissa`` bits after every token) against the fp32-state one, both fed the fp32 decoder's
    samples."""
    ids = prompts.to(device)
    cache = HypeNetCache(model.config.num_hidden_layers,
                         max_cache_len=ids.shape[1] + tokens + 8)
    logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    twin = copy.deepcopy(cache)
    ref = StaticDecoder(model, cache)
    other = StaticDecoder(model, twin, DecodeOptions(state_dtype=state_dtype))
    g = torch.Generator(device=device).manual_seed(seed)
    for s in other.cache.rnn_states():  # (drawn even when perturb is 0: the same samples)
        s.mul_(1 + perturb * torch.randn(s.shape, generator=g, device=device, dtype=s.dtype))
    if mantissa is not None:  # the prefilled state too, as a decoder keeping it narrower does
        round_mantissa(other, mantissa)
    nxt = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=g).view(-1)
    kl, tv, agree = [], [], []
    for _ in range(tokens):
        logp = torch.log_softmax(ref.step(nxt).float(), -1)  # [B, V]
        logq = torch.log_softmax(other.step(nxt).float(), -1)
        if mantissa is not None:
            round_mantissa(other, mantissa)
        p = logp.exp()
        kl.append((p * (logp - logq)).sum(-1).cpu())  # [B]
        tv.append(0.5 * (p - logq.exp()).abs().sum(-1).cpu())
        agree.append((logp.argmax(-1) == logq.argmax(-1)).float().cpu())
        nxt = torch.multinomial(p, 1, generator=g).view(-1)
    kl, tv, agree = (torch.stack(x, 1) for x in (kl, tv, agree))  # [B, tokens]
    rows = []
    for lo, hi in BUCKETS:
        if lo >= tokens:
            break
        sl = slice(lo, min(hi, tokens))
        rows.append({"positions": f"{lo + 1}-{min(hi, tokens)}",
                     "kl_mean": float(kl[:, sl].mean()), "kl_max": float(kl[:, sl].max()),
                     "tv_mean": float(tv[:, sl].mean()),
                     "argmax_agree": float(agree[:, sl].mean())})
    return {"buckets": rows, "kl_mean": float(kl.mean()), "tv_mean": float(tv.mean()),
            "argmax_agree": float(agree.mean())}


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model, prompts, device = build(args)
    t0 = time.perf_counter()
    if args.state_mantissa is not None:
        first = (f"fp32_rounded_to_{args.state_mantissa}_mantissa_bits",
                 drift(model, prompts, args.tokens, device, args.seed, None,
                       mantissa=args.state_mantissa))
    else:
        first = ("bf16_state", drift(model, prompts, args.tokens, device, args.seed))
    result = {first[0]: first[1],
              "control_fp32_perturbed_1e-3": drift(model, prompts, args.tokens, device,
                                                   args.seed, None, 1e-3)}
    result["seconds"] = time.perf_counter() - t0
    for key, r in result.items():
        if key == "seconds":
            continue
        print_table(r["buckets"], f"{key} vs fp32 rollout state, {args.student or args.model}, "
                    f"{args.rows} rows, {args.prompt_len}-token prompts, {args.tokens} tokens")
        print(f"all positions: KL {r['kl_mean']:.3e} nats, TV {r['tv_mean']:.3e}, "
              f"argmax agree {r['argmax_agree']:.4f}")
    name = "student" if args.student is not None else args.model
    suffix = f"_m{args.state_mantissa}" if args.state_mantissa is not None else ""
    out = args.out or RESULTS / f"rollout_state_drift_{name}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": environment(), "args": {k: str(v) for k, v in
                                                              vars(args).items()},
                               **result}, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
