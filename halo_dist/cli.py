"""`halo-dist` command line: one subcommand per user-facing step.

User mistakes (bad paths, bad layer lists, impossible settings) print one ``error:`` line plus a
hint and exit 2; real bugs still raise with a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time

from .errors import HaloUserError
from .outputs import add_overwrite_flag

EXAMPLES = {
    "convert": (
        "examples:\n"
        "  halo-dist convert --teacher Qwen/Qwen3-1.7B --attn-layers 2,3,6,8,9,21,25 --output "
        "out/hypenet-2b-init\n"
        "  halo-dist convert --teacher smollm2 --attn-layers 3,10,17,24 --output "
        "out/smol-hypenet\n"
        "  halo-dist convert --teacher DIR --attn-layers 1,2 --stage1-weights "
        "runs/s1/rnn_layers.safetensors --output OUT\n"),
    "import-official": (
        "examples:\n"
        "  halo-dist import-official ckpts/hypenet-2b/ckpt_500 --output out/hypenet-2b\n"
        "  (a folder written by the authors' build_hf_ckpt.py: their config.json and "
        "safetensors)\n"),
    "generate": (
        "examples:\n"
        "  halo-dist generate --model out/smol-hypenet --prompt \"The capital of Germany is\" "
        "--max-new-tokens 16\n"
        "  halo-dist generate --model smollm2 --prompt \"Hello\" --prompt \"Paris is\"\n"),
}


class UserError(HaloUserError):
    """A mistake in what the user asked for; printed as one line."""


def parse_layers(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace("[", "").replace("]", "").split(",") if t.strip()]
    except ValueError:
        raise UserError(f"--attn-layers must be comma-separated integers, got {text!r}") from None


def cmd_convert(args) -> int:
    import torch

    from .teacher import teacher_path
    from .models.convert import convert, describe

    overrides = {}
    if args.logits_scale_base is not None:
        overrides["attn_logits_scale_base"] = (None if args.logits_scale_base <= 0
                                               else args.logits_scale_base)
    for flag, key in (("no_rnn_rope", "rnn_rope"), ("no_rnn_qk_norm", "rnn_qk_norm"),
                      ("no_gates", None)):
        if getattr(args, flag):
            if key is None:
                overrides.update(attn_output_gate=False, rnn_output_gate=False)
            else:
                overrides[key] = False
    if args.attn_rope:
        overrides["attn_rope"] = True
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    t0 = time.time()
    student = convert(
        teacher_path(args.teacher), parse_layers(args.attn_layers), args.output,
        stage1_weights=args.stage1_weights, dtype=dtype, overwrite=args.overwrite, **overrides,
    )
    print(f"converted in {time.time() - t0:.1f}s: {describe(student)} -> {args.output}")
    return 0


def cmd_import_official(args) -> int:
    from .models.convert import describe
    from .models.official import import_official

    t0 = time.time()
    model = import_official(args.folder, args.output, overwrite=args.overwrite)
    print(f"imported in {time.time() - t0:.1f}s: {describe(model)} -> {args.output}")
    return 0


def cmd_generate(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .teacher import teacher_path
    from .models.trust import trust_for

    path = teacher_path(args.model)
    # our exported folders carry model code: trusted by content
    trust = trust_for(path, args.trust_remote_code)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust).eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    batch = tok(args.prompt, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    for prompt, row in zip(args.prompt, out):
        text = tok.decode(row[batch["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"{prompt!r} -> {text!r}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="halo-dist",
                                description="HALO distillation: Transformer -> HypeNet hybrid.")
    sub = p.add_subparsers(dest="command", required=True)
    fmt = argparse.RawDescriptionHelpFormatter

    c = sub.add_parser("convert", help="build a HypeNet student from a teacher (stage 0)",
                       epilog=EXAMPLES["convert"], formatter_class=fmt)
    c.add_argument("--teacher", required=True,
                   help="HF folder, hub id, .gguf file, or 'smollm2' (bundled)")
    c.add_argument("--attn-layers", required=True,
                   help="0-based layers kept as softmax attention, e.g. 2,3,6")
    c.add_argument("--output", required=True,
                   help="output folder (HF format, loads with trust_remote_code)")
    add_overwrite_flag(c)
    c.add_argument("--stage1-weights", help="safetensors of stage-1 trained RNN layers")
    c.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    c.add_argument("--logits-scale-base", type=float,
                   help="logits scaling base a (<=0 disables); default 500")
    c.add_argument("--attn-rope", action="store_true",
                   help="keep RoPE in attention layers (ablation)")
    c.add_argument("--no-rnn-rope", action="store_true", help="no RoPE in RNN layers (ablation)")
    c.add_argument("--no-rnn-qk-norm", action="store_true",
                   help="no QK-norm in RNN layers (ablation)")
    c.add_argument("--no-gates", action="store_true", help="no output gates (ablation)")
    c.set_defaults(func=cmd_convert)

    i = sub.add_parser("import-official",
                       help="import a HypeNet checkpoint of the authors' reference code",
                       epilog=EXAMPLES["import-official"], formatter_class=fmt)
    i.add_argument("folder", help="their Hugging Face folder (config.json + safetensors)")
    i.add_argument("--output", required=True,
                   help="output folder (HF HypeNet, loads with trust_remote_code)")
    add_overwrite_flag(i)
    i.set_defaults(func=cmd_import_official)

    g = sub.add_parser("generate", help="greedy generation from a model folder",
                       epilog=EXAMPLES["generate"], formatter_class=fmt)
    g.add_argument("--model", required=True, help="model folder or 'smollm2'")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="run code the folder carries; folders halo_dist exported are trusted "
                        "without it")
    g.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeat for a batch)")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.set_defaults(func=cmd_generate)

    # select-layers, eval-niah, calibrate-scaling, eval-lm
    from .eval.commands import register_eval_commands
    from .train.export_checkpoint import register_export_command  # export

    from .pipeline.demo import add_demo_command

    register_eval_commands(sub)
    from .eval.suite import add_suite_command

    add_suite_command(sub)
    register_export_command(sub)
    add_demo_command(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    # CPU evaluation: denormal arithmetic is 10-100x slower (see train/trainer.py)
    torch.set_flush_denormal(True)
    # user mistakes (HaloUserError) and a missing file print one line; anything else is a bug
    except_types = (HaloUserError, FileNotFoundError)
    try:
        return args.func(args)
    except except_types as e:
        print(f"error: {e}", file=sys.stderr)
        print(f"hint: run `halo-dist {args.command} --help` for usage and examples",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
