"""The README.md (model card) of an exported HypeNet folder.

Written from what the export knows: the config (layer plan, HyPE switches), the run record that also
goes to ``halo_dist.json`` (each stage's teacher, steps, tokens and held-out evaluation, oldest
first under ``history``), whether a tokenizer and a chat template came along, and the generation
defaults.
"""

from __future__ import annotations

import json
import os
import re

STAGE_NAMES = {
    "convert": "conversion (stage 0): teacher weights transferred, attention layers kept",
    "stage1": "stage 1: RNN layers aligned to the teacher's attention outputs",
    "stage2": "stage 2: end-to-end distillation",
    "stage3": "stage 3: long-context fine-tuning",
    "opd": "on-policy distillation",
    "pretrain": "pre-training from scratch",
    "checkpoint": "exported from a training checkpoint",
}
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def model_card(config, record: dict | None, *, tokenizer: bool, chat_template: bool,
               generation: dict) -> str:
    """Markdown with a YAML header. ``record``: the halo_dist.json content (None: nothing known of
    the run);
    ``generation``: the non-default entries of the exported generation_config.json."""
    record = dict(record or {})
    steps = list(record.pop("history", [])) + ([record] if record else [])
    teacher = next((s["teacher"] for s in reversed(steps) if s.get("teacher")), None)
    lines = ["---", "library_name: transformers", "tags:", "- halo_dist", "- hypenet",
             "- hybrid-rnn-attention"]
    if teacher and _HUB_ID.match(teacher) and not os.path.exists(teacher):
        lines += [f"base_model: {teacher}"]
    lines += ["---", "", f"# HypeNet hybrid{f' distilled from {teacher}' if teacher else ''}", ""]
    lines += _architecture(config)
    lines += ["## Recipe", ""] + (_recipe(steps) if steps else
                                  ["Not recorded: this folder was exported without a run record.",
                                   ""])
    lines += _evaluation(steps)
    lines += _tokenizer(tokenizer, chat_template)
    lines += _generation(generation)
    lines += _usage(tokenizer)
    return "\n".join(lines).rstrip() + "\n"


def _architecture(cfg) -> list[str]:
    kinds = cfg.mixer_types
    letter = {"attention": "A", "swa": "S"}
    plan = " ".join(letter.get(k, "R") for k in kinds)
    rnn = ", ".join(sorted({k for k in kinds if k not in letter}))
    scale, attn = cfg.attn_logits_scale_base, sorted(cfg.attn_layers)
    return [
        "## Architecture", "",
        f"{cfg.num_hidden_layers} layers, hidden size "
        f"{cfg.hidden_size}, {cfg.num_attention_heads} query heads "
        f"({cfg.num_key_value_heads} KV heads) of {cfg.head_dim}, vocabulary {cfg.vocab_size}.", "",
        "- Layer plan (A softmax attention, S sliding-window attention, R "
        f"RNN{': ' + rnn if rnn else ''}): `{plan}` (attention at layers {attn}).",
        f"- Positions (HyPE): RoPE in the RNN layers {'on' if cfg.rnn_rope else 'off'}, in the "
        f"attention layers {'on' if cfg.attn_rope else 'off'}; attention logits scaled by log(t + "
        f"a) / log(a) with {f'a = {scale:g}' if scale is not None else 'no scaling'}.",
        f"- Output gates: attention {'on' if cfg.attn_output_gate else 'off'}, RNN "
        f"{'on' if cfg.rnn_output_gate else 'off'}.", "",
        "The model code (`modeling_hypenet.py` and its companions) is in this folder: it loads "
        "with `trust_remote_code=True` and needs no halo_dist.", "",
    ]


def _recipe(steps: list[dict]) -> list[str]:
    rows = ["| # | stage | from | steps | tokens | sequence length |", "|---|---|---|---|---|---|"]
    for i, s in enumerate(steps, 1):
        stage = s.get("stage", "?")
        origin = []
        if s.get("teacher"):
            origin.append(f"teacher `{s['teacher']}`")
        # stage 1 trains an RNN for every layer (the selection comes after it): the layers its
        # config held are no choice of it
        if s.get("attn_layers") is not None and stage != "stage1":
            origin.append(f"attention layers {sorted(s['attn_layers'])}")
        for key in ("arch", "pe", "rnn_mixer", "horizon", "checkpoint"):
            if s.get(key) is not None:
                origin.append(f"{key} {s[key]}")
        rows.append(f"| {i} | {STAGE_NAMES.get(stage, stage)} | {', '.join(origin) or '-'} | "
                    f"{_count(s.get('step'))} | {_count(s.get('tokens'))} | "
                    f"{_count(s.get('seq_len'))} |")
    total = sum(int(s["tokens"]) for s in steps if s.get("tokens"))
    return rows + ["", f"Tokens trained on, all stages: {total:,}." if total
                   else "No token counts recorded.", ""]


def _evaluation(steps: list[dict]) -> list[str]:
    done = [s for s in steps if s.get("eval")]
    lines = ["## Evaluation", ""]
    if not done:
        return lines + ["No evaluation figures were recorded by the stages that produced this "
                        "model.", ""]
    lines += ["Held-out figures each stage recorded at its end (lower is better for KL and "
              "cross-entropy):", "", "| stage | metric | value |", "|---|---|---|"]
    for s in done:
        for tag, value in s["eval"].items():
            lines.append(f"| {s.get('stage', '?')} | {tag} | {value:.4f} |")
    return lines + [""]


def _tokenizer(tokenizer: bool, chat_template: bool) -> list[str]:
    if not tokenizer:
        return ["## Tokenizer", "",
                "**This export has no tokenizer.** It was written without one (the teacher's could "
                "not be loaded, or none was given): tokenize with the teacher's tokenizer, whose "
                "vocabulary the model shares.", ""]
    return ["## Tokenizer", "",
            "The tokenizer (a distilled model's is its teacher's) is included" +
            (", with its chat template (`tok.apply_chat_template`)." if chat_template
             else "; it has no chat template."),
            "", "`AutoTokenizer` reads `config.json` before the tokenizer files, and that names "
                "this folder's model code: pass `trust_remote_code=True`, or transformers stops "
                "to ask. `PreTrainedTokenizerFast.from_pretrained(path)` loads the same tokenizer "
                "without running any code (`AutoTokenizer` with `trust_remote_code=False` does "
                "too, after a warning that it reads a `hypenet` config as a generic one).", ""]


def _generation(generation: dict) -> list[str]:
    noise = ("transformers_version", "_from_model_config", "output_attentions",
             "output_hidden_states")
    shown = {k: v for k, v in generation.items() if k not in noise}
    lines = ["## Generation defaults", ""]
    if generation.get("_from_model_config"):
        lines += ["`generation_config.json` holds the special tokens of `config.json` only (no "
                  "teacher generation config came with the export)."]
    else:
        lines += ["`generation_config.json` is the teacher's: `model.generate` applies these "
                  "unless told otherwise."]
    return lines + ["", "```json", json.dumps(shown, indent=2, sort_keys=True), "```", ""]


def _usage(tokenizer: bool) -> list[str]:
    tok = ("tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)\n"
           "batch = tok([\"The capital of France is\"], return_tensors=\"pt\")\n" if tokenizer
           else "batch = {\"input_ids\": torch.tensor([[1, 2, 3]])}  # ids from the teacher's "
                "tokenizer\n")
    return ["## Usage", "", "```python", "import torch",
            "from transformers import AutoModelForCausalLM"
            + (", AutoTokenizer" if tokenizer else ""), "", "path = \"PATH/TO/THIS/FOLDER\"",
            "model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)",
            tok.rstrip("\n"),
            "out = model.generate(**batch, max_new_tokens=32)  # any GenerationConfig option, "
            "beam search, streamers", "out = model.generate(**batch, max_new_tokens=32, "
                                      "cache_implementation=\"static\")  # CUDA-graph decoding",
            "```", "",
            "Batches must be left-padded (each row then generates exactly what it would alone).",
            ""]


def _count(value) -> str:
    return f"{int(value):,}" if value is not None else "-"
