"""Teacher -> HypeNet conversion (HALO stage 0).

``convert(teacher, attn_layers, output)`` builds a HypeNet student from a Qwen3 teacher or a
Llama/Qwen2/Mistral-style GQA teacher:
  * attention layers keep the teacher's W_q/W_k/W_v/W_o (+ biases, + q/k norms);
  * RNN layers get the same weights with KV heads cloned per query head (GQA -> MHA: head i <- KV
    head i // g), the teacher's q/k norms (or fresh ones at 1), a fresh per-head output norm at 1;
  * embeddings, MLPs, norms and lm_head are copied exactly, tied only where the teacher ties;
  * output gates W_z = 0 with gate = 2·sigmoid(x W_z), i.e. exactly 1 at the start.
Trained stage-1 RNN weights (a safetensors file, keys named as in the student) replace the
transferred RNN weights when given.

``rnn_mixer`` picks the replacement mixer: "lightning" (default),
"gdn", "gla", "rwkv7", "mamba2" -- all attention-shaped, so W_q/W_k/W_v/W_o (+ q/k norms) transfer
as for Lightning and only their gate / decay parameters start fresh (seeded per layer) -- or "swa"
(sliding-window attention: the teacher's attention weights unchanged, GQA kept).

Everything that can be checked from the teacher's config is checked before a weight is loaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import HaloUserError
from .hypenet import HypeNetConfig, HypeNetForCausalLM
from .hypenet.configuration_hypenet import RNN_MIXERS
from .hypenet.modeling_hypenet import MIXER_CLASSES

REPLACEMENT_MIXERS = (*RNN_MIXERS, "swa")
ATTENTION_SHAPED = ("attention", "swa")  # k/v keep the teacher's KV heads, attention switches apply

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
}


class ConversionError(HaloUserError, ValueError):
    """A teacher, layer list or weights file that cannot be converted (message names the
    problem)."""


@dataclass
class TeacherSource:
    """Where a teacher lives: an HF folder / hub id, optionally a GGUF file inside it."""

    path: str
    gguf_file: str | None = None

    def load_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve_teacher(teacher: str, flag: str | None = None) -> TeacherSource:
    """Accept a folder, a ``.gguf`` file, or a hub id. Folders must hold weights (checked here).
    ``flag``: the command-line flag that named it (``--model``), which the errors then name instead
    of "teacher"."""
    p = Path(teacher)
    name = f"{flag} {p}" if flag else f"teacher folder {p}"
    if p.is_file() and p.suffix == ".gguf":
        return TeacherSource(str(p.parent), p.name)
    if p.is_dir():
        weights = [f for f in os.listdir(p) if f.endswith((".safetensors", ".bin", ".gguf", ".pt"))]
        if not weights:
            raise ConversionError(f"{name} holds no weights (*.safetensors, *.bin or *.gguf)")
        if not (p / "config.json").exists():
            ggufs = [w for w in weights if w.endswith(".gguf")]
            if not ggufs:
                raise ConversionError(f"{name} has no config.json")
            return TeacherSource(str(p), ggufs[0])
        return TeacherSource(str(p))
    if teacher.startswith((".", "/")) or os.sep in teacher.rstrip("/").split("/", 1)[-1]:
        raise ConversionError(f"{flag or 'teacher path'} {teacher} does not exist")
    return TeacherSource(teacher)  # a hub id: transformers resolves it (needs network or HF cache)


def load_teacher_config(source: TeacherSource):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source.path, **source.load_kwargs())


def rope_theta_of(cfg) -> float:
    """RoPE base from transformers 4 (``rope_theta``) or 5 (``rope_parameters``) configs; only plain
    RoPE."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = (params.get("rope_type", params.get("type", "default")) if isinstance(params, dict)
                 else "default")
    if rope_type not in ("default", None):
        raise ConversionError(f"teacher rope type {rope_type!r} is not supported (only plain RoPE)")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    theta = theta if theta is not None else getattr(cfg, "rope_theta", None)
    if theta is None:
        raise ConversionError("teacher config has no rope_theta")
    return float(theta)


def teacher_family(cfg) -> str:
    archs = getattr(cfg, "architectures", None) or []
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[a]
    model_type = getattr(cfg, "model_type", None)
    if not archs and model_type in SUPPORTED_ARCHITECTURES.values():
        return model_type  # a config built in memory carries no `architectures`
    name = archs[0] if archs else model_type
    raise ConversionError(
        f"unknown teacher architecture {name!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def check_attn_layers(attn_layers: list[int], num_layers: int) -> list[int]:
    layers = list(attn_layers)
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ConversionError(f"attention layer indices {bad} out of range for a "
                              f"{num_layers}-layer teacher")
    dup = sorted({i for i in layers if layers.count(i) > 1})
    if dup:
        raise ConversionError(f"attention layer indices repeated: {dup}")
    return sorted(layers)


def student_config(teacher_cfg, attn_layers: list[int], rnn_mixer: str = "lightning",
                   **overrides) -> HypeNetConfig:
    """HypeNetConfig mirroring the teacher's shapes; layers outside ``attn_layers`` become
    ``rnn_mixer``;
    ``overrides`` set HyPE switches (e.g. ``attn_logits_scale_base``)."""
    if rnn_mixer not in REPLACEMENT_MIXERS:
        raise ConversionError(f"rnn_mixer={rnn_mixer!r} is unknown; choose from "
                              f"{REPLACEMENT_MIXERS}")
    family = teacher_family(teacher_cfg)
    L = teacher_cfg.num_hidden_layers
    attn = check_attn_layers(attn_layers, L)
    H = teacher_cfg.num_attention_heads
    Hkv = getattr(teacher_cfg, "num_key_value_heads", None) or H
    if H % Hkv:
        raise ConversionError(f"teacher has {H} query heads, not divisible by {Hkv} KV heads")
    head_dim = getattr(teacher_cfg, "head_dim", None) or teacher_cfg.hidden_size // H
    attention_bias = bool(getattr(teacher_cfg, "attention_bias", False))
    qkv_bias, o_bias = {"qwen2": (True, False)}.get(family, (attention_bias, attention_bias))
    if getattr(teacher_cfg, "use_sliding_window", False):
        raise ConversionError("teacher uses sliding-window attention; convert a full-attention "
                              "teacher")
    if getattr(teacher_cfg, "hidden_act", "silu") != "silu":
        raise ConversionError(f"teacher hidden_act {teacher_cfg.hidden_act!r}: only SwiGLU "
                              "teachers are supported")
    kwargs = dict(
        vocab_size=teacher_cfg.vocab_size,
        hidden_size=teacher_cfg.hidden_size,
        intermediate_size=teacher_cfg.intermediate_size,
        num_hidden_layers=L,
        num_attention_heads=H,
        num_key_value_heads=Hkv,
        head_dim=head_dim,
        max_position_embeddings=max(getattr(teacher_cfg, "max_position_embeddings", 0) or 0,
                                    1 << 20),
        rms_norm_eps=teacher_cfg.rms_norm_eps, rope_theta=rope_theta_of(teacher_cfg),
        tie_word_embeddings=bool(getattr(teacher_cfg, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(getattr(teacher_cfg, "mlp_bias", False)),
        mixer_types=["attention" if i in attn else rnn_mixer for i in range(L)],
        attn_qk_norm=family == "qwen3",
        bos_token_id=getattr(teacher_cfg, "bos_token_id", None),
        eos_token_id=getattr(teacher_cfg, "eos_token_id", None),
        pad_token_id=getattr(teacher_cfg, "pad_token_id", None),
        teacher_name_or_path=getattr(teacher_cfg, "_name_or_path", None),
    )
    kwargs.update(overrides)
    try:
        return HypeNetConfig(**kwargs)
    except ValueError as e:
        raise ConversionError(str(e)) from e


# ------------------------------------------------------------------------------------------------
# Weight transfer
# ------------------------------------------------------------------------------------------------


def _clone_kv_heads(w: torch.Tensor, num_kv: int, group: int, head_dim: int) -> torch.Tensor:
    """GQA -> MHA: ``[Hkv*D, ...]`` -> ``[Hkv*g*D, ...]`` with head i a copy of KV head i // g."""
    rest = w.shape[1:]
    per_head = w.reshape(num_kv, head_dim, *rest)  # [Hkv*D, ...] -> [Hkv, D, ...]
    return per_head.repeat_interleave(group, dim=0).reshape(num_kv * group * head_dim, *rest)


def transfer_state_dict(teacher_sd: dict[str, torch.Tensor],
                        cfg: HypeNetConfig) -> dict[str, torch.Tensor]:
    """Map a teacher state dict (HF Llama/Qwen naming) onto HypeNet parameter names."""
    sd: dict[str, torch.Tensor] = {}
    t = lambda k: teacher_sd[k].clone()  # noqa: E731 - never alias the teacher's storage
    sd["model.embed_tokens.weight"] = t("model.embed_tokens.weight")
    sd["model.norm.weight"] = t("model.norm.weight")
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = t("lm_head.weight")
    H, Hkv, D, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    for i, mixer in enumerate(cfg.mixer_types):
        src, dst = f"model.layers.{i}.", f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm"):
            sd[dst + name + ".weight"] = t(src + name + ".weight")
        for name in ("gate_proj", "up_proj", "down_proj"):
            for p in ("weight", "bias"):
                if src + f"mlp.{name}.{p}" in teacher_sd:
                    sd[dst + f"mlp.{name}.{p}"] = t(src + f"mlp.{name}.{p}")
        attn, mix = src + "self_attn.", dst + "mixer."
        attn_shaped = mixer in ATTENTION_SHAPED
        clone_kv = not attn_shaped and cfg.rnn_gqa_to_mha and Hkv != H
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            for p in ("weight", "bias"):
                key = attn + f"{proj}.{p}"
                if key not in teacher_sd:
                    continue
                w = t(key)
                if clone_kv and proj in ("k_proj", "v_proj"):
                    w = _clone_kv_heads(w, Hkv, H // Hkv, D)
                sd[mix + f"{proj}.{p}"] = w
        has_qk_norm = attn + "q_norm.weight" in teacher_sd
        wants_qk_norm = cfg.attn_qk_norm if attn_shaped else cfg.rnn_qk_norm
        if wants_qk_norm:
            for n in ("q_norm", "k_norm"):
                sd[mix + f"{n}.weight"] = t(attn + f"{n}.weight") if has_qk_norm else torch.ones(D)
        gated = cfg.attn_output_gate if attn_shaped else cfg.rnn_output_gate
        if gated:
            sd[mix + "g_proj.weight"] = torch.zeros(H * D, d, dtype=sd[mix + "q_proj.weight"].dtype)
        if not attn_shaped or cfg.attn_output_norm:
            sd[mix + "o_norm.weight"] = torch.ones(H * D)
        if mixer not in ("attention", "lightning", "swa"):
            fresh = fresh_mixer_parameters(cfg, i)
            sd.update({mix + k: w.to(sd[mix + "q_proj.weight"].dtype)
                       for k, w in fresh.items() if mix + k not in sd})
    return sd


def fresh_mixer_parameters(cfg: HypeNetConfig, layer: int) -> dict[str, torch.Tensor]:
    """A freshly initialised mixer of layer ``layer`` (seeded by the layer index, so conversion is
    deterministic): Linear weights N(0, initializer_range), biases 0, the mixer's own decay / skip
    parameters from its ``init_mixer_parameters``. Keys relative to the mixer."""
    mixer = MIXER_CLASSES[cfg.mixer_types[layer]](cfg, layer)
    gen = torch.Generator().manual_seed(layer)
    with torch.no_grad():
        for module in mixer.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, cfg.initializer_range, generator=gen)
                if module.bias is not None:
                    module.bias.zero_()
        mixer.init_mixer_parameters()
    return {k: v.detach().clone() for k, v in mixer.state_dict().items()}


def load_stage1_weights(
    path: str | os.PathLike, cfg: HypeNetConfig, student_keys: dict[str, torch.Size],
    only_layers: set[int] | None = None
):
    """Read trained RNN-layer weights (safetensors) and check they fit this student before use.

    Keys of layers outside ``only_layers`` are ignored (a stage-1 file holds every layer's RNN)."""
    from safetensors.torch import load_file, safe_open

    path = Path(path)
    if not path.exists():
        raise ConversionError(f"stage-1 weights file {path} does not exist")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if "num_hidden_layers" in meta and int(meta["num_hidden_layers"]) != cfg.num_hidden_layers:
        raise ConversionError(
            f"stage-1 weights {path} were trained for {meta['num_hidden_layers']} layers, "
            f"teacher has {cfg.num_hidden_layers}"
        )
    # files before model.pe: no key
    if "rnn_rope" in meta and (meta["rnn_rope"] == "true") != cfg.rnn_rope:
        raise ConversionError(
            f"stage-1 weights {path} were aligned with rnn_rope={meta['rnn_rope']}, this student "
            f"has rnn_rope={str(cfg.rnn_rope).lower()}: give stage 2 the model.pe of the stage-1 "
            "run"
        )
    weights = load_file(str(path))
    foreign = [
        k for k in weights if _layer_of(k) is None or not 0 <= _layer_of(k) < cfg.num_hidden_layers]
    if foreign:
        raise ConversionError(f"stage-1 weights {path}: key {foreign[0]!r} is not a student "
                              "parameter")
    if only_layers is not None:
        weights = {k: w for k, w in weights.items() if _layer_of(k) in only_layers}
    for key, w in weights.items():
        if key not in student_keys:
            raise ConversionError(f"stage-1 weights {path}: key {key!r} is not a student parameter")
        if tuple(w.shape) != tuple(student_keys[key]):
            raise ConversionError(
                f"stage-1 weights {path}: {key!r} has shape {tuple(w.shape)}, student expects "
                f"{tuple(student_keys[key])}"
            )
    return weights


def build_student(cfg: HypeNetConfig, state_dict: dict[str, torch.Tensor],
                  dtype=None) -> HypeNetForCausalLM:
    """Instantiate without random init (meta device) holding ``state_dict``'s tensors; every weight
    must be there."""
    from .export import ExportError, meta_model_with

    try:
        model = meta_model_with(state_dict, cfg, source="teacher weights")
    except ExportError as err:
        raise ConversionError(str(err)) from None
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def convert_model(
    teacher_model, attn_layers: list[int], stage1_weights=None,
    stage1_layers: list[int] | None = None, **overrides
) -> HypeNetForCausalLM:
    """In-memory conversion of a loaded HF teacher.

    ``stage1_weights`` (safetensors, student key names ``model.layers.{i}.mixer.*``) may hold
    trained RNN mixers for every layer (stage 1 trains all of them); only the student's RNN layers —
    or ``stage1_layers`` if given — are taken from it.
    """
    cfg = student_config(teacher_model.config, attn_layers, **overrides)
    teacher_sd = {k: v.detach() for k, v in teacher_model.state_dict().items()}
    sd = transfer_state_dict(teacher_sd, cfg)
    if stage1_weights is not None:
        wanted = set(cfg.rnn_layers if stage1_layers is None else stage1_layers)
        bad = sorted(wanted - set(cfg.rnn_layers))
        if bad:
            raise ConversionError(f"stage1_layers {bad} are attention layers in this student")
        shapes = {k: v.shape for k, v in sd.items() if _layer_of(k) in wanted}
        trained = load_stage1_weights(stage1_weights, cfg, shapes, only_layers=wanted)
        sd.update({k: v.to(sd[k].dtype) for k, v in trained.items()})
    return build_student(cfg, sd)


# the teacher's own function as a HypeNet: every layer attention, RoPE on, no logits scaling, no
# gates
EXACT_TEACHER = dict(attn_rope=True, attn_logits_scale_base=None, attn_output_gate=False,
                     rnn_output_gate=False)


def as_exact_hypenet(hf_teacher) -> HypeNetForCausalLM:
    """All-attention HypeNet computing exactly the teacher's function, frozen."""
    layers = list(range(hf_teacher.config.num_hidden_layers))
    teacher = convert_model(hf_teacher, layers, **EXACT_TEACHER)
    teacher.requires_grad_(False)
    return teacher.eval()


def _layer_of(key: str) -> int | None:
    """``model.layers.7.mixer.q_proj.weight`` -> 7."""
    parts = key.split(".")
    return int(parts[2]) if len(parts) > 3 and parts[:2] == ["model", "layers"] else None


def teacher_generation_config(source: TeacherSource):
    """The teacher's generation defaults (generation_config.json) for its student's export; None for
    a GGUF teacher or one without the file."""
    from .export import load_generation_config

    return None if source.gguf_file else load_generation_config(source.path)


def load_teacher(source: TeacherSource, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype,
                                                **source.load_kwargs()).eval()


def convert(
    teacher: str,
    attn_layers: list[int],
    output: str | os.PathLike | None = None,
    stage1_weights: str | None = None,
    dtype: torch.dtype = torch.float32,
    tokenizer: bool = True,
    overwrite: bool = False,
    **overrides,
) -> HypeNetForCausalLM:
    """Full conversion: validate config -> load teacher -> transfer -> (optionally) export to
    ``output`` (an earlier export of ours there is replaced only with ``overwrite``)."""
    from ..outputs import check_output

    source = resolve_teacher(teacher)
    # fails before any weight loads
    cfg = student_config(load_teacher_config(source), attn_layers, **overrides)
    inputs = {"teacher": Path(source.path) / (source.gguf_file or ""),
              "stage-1 weights": stage1_weights}
    if output is not None:  # refused before any weight loads
        check_output(output, inputs, overwrite)
    if stage1_weights is not None and not Path(stage1_weights).exists():
        raise ConversionError(f"stage-1 weights file {stage1_weights} does not exist")
    teacher_model = load_teacher(source, dtype)
    student = convert_model(teacher_model, attn_layers, stage1_weights, **overrides)
    del teacher_model
    if output is not None:
        from .export import export_hypenet

        tok = None
        if tokenizer:
            from transformers import AutoTokenizer

            try:
                tok = AutoTokenizer.from_pretrained(source.path, **source.load_kwargs())
            except Exception:  # a teacher without a tokenizer still converts
                tok = None
        export_hypenet(student, output, tokenizer=tok,
                       generation_config=teacher_generation_config(source),
                       extra={"stage": "convert", "teacher": teacher,
                              "attn_layers": cfg.attn_layers}, overwrite=overwrite, inputs=inputs)
    assert cfg.to_dict()["mixer_types"] == student.config.mixer_types
    return student


def describe(student: HypeNetForCausalLM) -> str:
    cfg = student.config
    n = sum(p.numel() for p in student.parameters())
    return json.dumps({"params": n, "layers": cfg.num_hidden_layers,
                       "attn_layers": cfg.attn_layers})
