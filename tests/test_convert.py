"""Conversion: real offline teacher, stage-1 weights, bad input, CLI."""

import json

import pytest
import torch
from conftest import tiny_qwen3

from halo_dist import cli
from halo_dist.models import convert as conv


@pytest.fixture
def qwen3_folder(tmp_path):
    teacher = tiny_qwen3()
    teacher.save_pretrained(tmp_path / "teacher")
    return tmp_path / "teacher", teacher


def test_real_smollm2_teacher_converts_and_all_attention_reproduces_it(smollm2_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    teacher = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    L = teacher.config.num_hidden_layers
    student = conv.convert_model(teacher, list(range(L)), attn_rope=True,
                                 attn_logits_scale_base=None)
    assert student.config.num_key_value_heads == 3 and student.config.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    x = tok(["The capital of Germany is", "Water boils at"], return_tensors="pt",
            padding=True)["input_ids"]
    with torch.no_grad():
        diff = (teacher(x).logits - student(x).logits).abs().max().item()
    assert diff <= 1e-4, diff
    # the hybrid conversion (default HyPE) runs and greedy-decodes through the CLI path as well
    hybrid = conv.convert(str(smollm2_dir), [3, 10, 17, 24], tmp_path / "smol-hypenet")
    assert hybrid.config.attn_layers == [3, 10, 17, 24]
    assert ((tmp_path / "smol-hypenet" / "tokenizer.json").exists()
            or (tmp_path / "smol-hypenet" / "tokenizer_config.json").exists())


def test_stage1_weights_replace_rnn_layers(qwen3_folder, tmp_path):
    from safetensors.torch import save_file

    folder, teacher = qwen3_folder
    base = conv.convert_model(teacher, [0, 2])
    trained = {k: torch.randn_like(v)
               for k, v in base.state_dict().items() if k.startswith("model.layers.1.mixer.")}
    path = tmp_path / "rnn.safetensors"
    save_file(trained, str(path), metadata={"num_hidden_layers": "4"})
    student = conv.convert_model(teacher, [0, 2], stage1_weights=path)
    sd = student.state_dict()
    for k, v in trained.items():
        assert torch.equal(sd[k], v)
    assert torch.equal(sd["model.layers.3.mixer.q_proj.weight"],
                       base.state_dict()["model.layers.3.mixer.q_proj.weight"])


def test_a_stage1_aligner_state_under_wrapper_prefixes_becomes_the_file_conversion_reads(
    qwen3_folder, tmp_path):
    """The stage-1 naming (``mixers.i.*`` -> ``model.layers.i.mixer.*``) of the stage's output and
    of ``halo-dist export``: a DeepSpeed-wrapped aligner state round-trips into a stage-2
    student."""
    from halo_dist.stages.stage1 import save_stage1_weights, stage1_state_dict

    _, teacher = qwen3_folder
    all_rnn = conv.convert_model(teacher, [])
    state = {f"module.mixers.{i}.{k}": torch.randn_like(v)
             for i, layer in enumerate(all_rnn.model.layers)
             for k, v in layer.mixer.state_dict().items()}
    weights = stage1_state_dict(state)
    assert set(weights) == {k for k in all_rnn.state_dict() if ".mixer." in k}
    path = save_stage1_weights(weights, tmp_path / "s1", 4, "tiny",
                               rnn_rope=all_rnn.config.rnn_rope)
    sd = conv.convert_model(teacher, [0, 2], stage1_weights=path).state_dict()
    for i in (1, 3):
        assert torch.equal(sd[f"model.layers.{i}.mixer.q_proj.weight"],
                           state[f"module.mixers.{i}.q_proj.weight"])


def test_stage1_weights_that_do_not_fit_are_refused(qwen3_folder, tmp_path):
    from safetensors.torch import save_file

    _, teacher = qwen3_folder
    bad_shape = tmp_path / "bad.safetensors"
    save_file({"model.layers.1.mixer.q_proj.weight": torch.zeros(3, 3)}, str(bad_shape))
    with pytest.raises(conv.ConversionError, match="shape"):
        conv.convert_model(teacher, [0], stage1_weights=bad_shape)
    bad_key = tmp_path / "key.safetensors"
    save_file({"model.layers.9.mixer.q_proj.weight": torch.zeros(3, 3)}, str(bad_key))
    with pytest.raises(conv.ConversionError, match="not a student parameter"):
        conv.convert_model(teacher, [0], stage1_weights=bad_key)
    bad_layers = tmp_path / "layers.safetensors"
    save_file({}, str(bad_layers), metadata={"num_hidden_layers": "28"})
    with pytest.raises(conv.ConversionError, match="28 layers"):
        conv.convert_model(teacher, [0], stage1_weights=bad_layers)


@pytest.mark.parametrize(
    "layers, message",
    [([0, 7], "out of range"), ([1, 1], "repeated"), ([-1], "out of range")],
)
def test_bad_layer_lists_fail_before_loading_weights(qwen3_folder, monkeypatch, tmp_path, layers,
                                                     message):
    folder, _ = qwen3_folder
    monkeypatch.setattr(conv, "load_teacher", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(conv.ConversionError, match=message):
        conv.convert(str(folder), layers, tmp_path / "out")


def test_unknown_architecture_and_missing_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(conv, "load_teacher", lambda *a, **k: pytest.fail("weights were loaded"))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (gpt2 / "model.safetensors").write_bytes(b"")
    with pytest.raises(conv.ConversionError,
                       match="unknown teacher architecture 'GPT2LMHeadModel'"):
        conv.convert(str(gpt2), [0], tmp_path / "o")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(conv.ConversionError, match="holds no weights"):
        conv.convert(str(empty), [0], tmp_path / "o")
    with pytest.raises(conv.ConversionError, match="does not exist"):
        conv.convert(str(tmp_path / "nope"), [0], tmp_path / "o")


def test_a_transfer_missing_a_weight_is_refused_naming_it():
    student = conv.convert_model(tiny_qwen3(layers=2), [0])
    sd = {k: v for k, v in student.state_dict().items() if k != "model.norm.weight"}
    with pytest.raises(conv.ConversionError,
                       match=r"teacher weights: missing 1 weight\(s\) of the model: model\.norm"):
        conv.build_student(student.config, sd)


def test_heads_that_cannot_divide_are_refused():
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_attention_heads=6, num_key_value_heads=4, hidden_size=48,
                      num_hidden_layers=2)
    cfg.architectures = ["LlamaForCausalLM"]
    with pytest.raises(conv.ConversionError, match="not divisible"):
        conv.student_config(cfg, [0])


def test_kv_expand_factor_for_sequence_parallel():
    from halo_dist.models.hypenet.sequence_parallel_hypenet import kv_expand_factor

    assert kv_expand_factor(16, 8, 4) == 1
    assert kv_expand_factor(16, 8, 16) == 2
    assert kv_expand_factor(32, 8, 32) == 4
    with pytest.raises(ValueError, match="cannot split"):
        kv_expand_factor(12, 4, 8)


def test_cli_convert_and_generate(qwen3_folder, tmp_path, capsys):
    folder, _ = qwen3_folder
    out = tmp_path / "student"
    assert cli.main(["convert", "--teacher", str(folder), "--attn-layers", "0,2", "--output",
                     str(out)]) == 0
    assert (json.loads((out / "config.json").read_text())["mixer_types"]
            == ["attention", "lightning", "attention", "lightning"])
    assert cli.main(["convert", "--teacher", str(folder), "--attn-layers", "0,9", "--output",
                     str(out)]) == 2
    err = capsys.readouterr().err
    assert "error: attention layer indices [9] out of range" in err and "hint:" in err
    assert cli.main(["convert", "--teacher", str(folder), "--attn-layers", "a,b", "--output",
                     str(out)]) == 2


@pytest.mark.parametrize("architecture", ["qwen3", "llama"])
def test_random_teacher_family_and_its_exact_hypenet(architecture):
    """model.random_teacher.architecture builds that HF family (Llama: no QK-norm, as SmolLM2); the
    all-attention HypeNet the stages train against reproduces its logits."""
    import torch

    from halo_dist.config import load_config
    from halo_dist.config.loader import with_overrides
    from halo_dist.models.convert import as_exact_hypenet
    from halo_dist.teacher import load_hf_teacher

    cfg = with_overrides(load_config("configs/tiny/stage2.yaml"),
                         {"model.random_teacher.architecture": architecture})
    hf = load_hf_teacher(cfg.model)
    assert type(hf).__name__ == {"qwen3": "Qwen3ForCausalLM",
                                 "llama": "LlamaForCausalLM"}[architecture]
    ids = torch.randint(0, hf.config.vocab_size, (2, 24))
    assert torch.allclose(hf(ids).logits, as_exact_hypenet(hf)(ids).logits, atol=1e-5)


# ------------------------------------------------------------------ model.pe of distilled students
def _distilled_student_config(*overrides):
    """The student stage 2 builds from the tiny random teacher (the launcher's path), without
    stage-1 weights."""
    from halo_dist.config import load_config
    from halo_dist.stages import build_distill_module

    cfg = load_config("configs/tiny/stage2.yaml", ["model.stage1_weights=null", *overrides])
    module, _ = build_distill_module(cfg)
    return module.student.config.to_dict()


def test_model_pe_sets_the_rope_of_a_converted_student():
    """model.pe=all_rope (the HyPE ablation: the teacher's attention RoPE kept) reaches the student;
    null stays HyPE (attention NoPE, RNN RoPE); nothing else differs, logits scaling included."""
    from halo_dist.config import load_config

    for stage in ("stage1", "stage2"):
        assert (load_config(f"configs/tiny/{stage}.yaml", ["model.pe=all_rope"]).model.pe
                == "all_rope")
    ablation, default = _distilled_student_config("model.pe=all_rope"), _distilled_student_config()
    assert (ablation["attn_rope"], ablation["rnn_rope"]) == (True, True)
    assert (default["attn_rope"], default["rnn_rope"]) == (False, True)
    assert {k for k in default if default[k] != ablation[k]} == {"attn_rope"}
    assert ablation["attn_logits_scale_base"] == 500.0  # still applied when set


def test_stage1_weights_aligned_with_another_rnn_rope_are_refused(qwen3_folder, tmp_path):
    from halo_dist.stages.stage1 import save_stage1_weights

    _, teacher = qwen3_folder
    # e.g. stage 1 ran pe=all_nope
    path = save_stage1_weights({}, tmp_path / "s1", 4, "tiny", rnn_rope=False)
    with pytest.raises(conv.ConversionError,
                       match="aligned with rnn_rope=false, this student has rnn_rope=true"):
        conv.convert_model(teacher, [0], stage1_weights=path)
    assert conv.convert_model(teacher, [0], stage1_weights=path,
                              rnn_rope=False).config.rnn_rope is False


def test_stage3_refuses_a_model_pe_that_its_student_init_folder_does_not_have(tmp_path,
                                                                              monkeypatch):
    """The folder's config.json decides the encoding; a disagreeing model.pe stops before the
    teacher loads."""
    import halo_dist.stages as stages
    import halo_dist.stages.build as build
    from halo_dist.config import ConfigError, load_config
    from halo_dist.models.hypenet import HypeNetConfig
    from halo_dist.opd.build import build_models

    # hype
    HypeNetConfig(num_hidden_layers=2,
                  mixer_types=["attention", "lightning"]).save_pretrained(tmp_path)
    monkeypatch.setattr(build, "load_hf_teacher", lambda m: pytest.fail("the teacher was loaded"))
    cfg = load_config("configs/tiny/stage3.yaml",
                      [f"model.student_init={tmp_path}", "model.pe=all_rope"])
    with pytest.raises(ConfigError,
                       match=r"model.pe: all_rope \(attn_rope=True, rnn_rope=True\) disagrees with "
                             rf"model.student_init={tmp_path}, whose config.json has "
                             r"attn_rope=False, "
                       r"rnn_rope=True \(pe hype\): set model.pe=null"):
        stages.build_distill_module(cfg)
    opd = load_config("configs/opd/tiny.yaml",
                      [f"model.student_init={tmp_path}", "model.pe=all_nope"])
    monkeypatch.setattr("halo_dist.teacher.load_hf_teacher",
                        lambda m: pytest.fail("the teacher was loaded"))
    with pytest.raises(ConfigError,
                       match="model.pe: all_nope .* disagrees with model.student_init"):
        build_models(opd)  # OPD from a folder: the same check
    for agreeing in ("model.pe=hype", "model.pe=null"):
        stages.check_student_init_pe(load_config("configs/tiny/stage3.yaml",
                                                 [f"model.student_init={tmp_path}",
                                                  agreeing]).model)
