"""HypeNet model properties."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import assert_left_padded_generate_matches_alone, tiny_qwen3

from halo_dist.models import hypenet as hypenet_package
from halo_dist.models.convert import convert_model
from halo_dist.models.export import MODEL_FILES, export_hypenet
from halo_dist.models.hypenet import HypeNetCache, HypeNetConfig

EXACT = dict(attn_rope=True, attn_logits_scale_base=None)


def logits(model, x, **kw):
    with torch.no_grad():
        return model(x, **kw).logits


@pytest.mark.parametrize("tie", [False, True])
def test_all_attention_student_reproduces_qwen3(tie):
    teacher = tiny_qwen3(tie=tie)
    student = convert_model(teacher, [0, 1, 2, 3], attn_output_gate=False, **EXACT)
    assert student.config.tie_word_embeddings == tie
    assert (student.lm_head.weight is student.model.embed_tokens.weight) == tie
    x = torch.randint(0, 256, (2, 40))
    assert (logits(teacher, x) - logits(student, x)).abs().max() <= 1e-4


def test_output_gate_init_keeps_teacher_function():
    """Gates on (W_z = 0, gate = 2·sigmoid(0) = 1): still the teacher, and W_z gets gradient."""
    teacher = tiny_qwen3()
    student = convert_model(teacher, [0, 1, 2, 3], **EXACT)
    x = torch.randint(0, 256, (2, 24))
    assert (logits(teacher, x) - logits(student, x)).abs().max() <= 1e-4
    student.train()
    student(x, labels=x).loss.backward()
    assert student.model.layers[0].mixer.g_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_all_attention_student_reproduces_llama_and_qwen2(family):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    common = dict(vocab_size=200, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, rope_theta=10000.0)
    teacher = (LlamaForCausalLM(LlamaConfig(**common)) if family == "llama"
               else Qwen2ForCausalLM(Qwen2Config(**common))).eval()
    with torch.no_grad():
        for p in teacher.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.normal_(0.5, 0.2)
    student = convert_model(teacher, [0, 1, 2], **EXACT)
    assert student.config.qkv_bias == (family == "qwen2") and not student.config.o_bias
    x = torch.randint(0, 200, (2, 30))
    assert (logits(teacher, x) - logits(student, x)).abs().max() <= 1e-4


def test_gqa_to_mha_cloning_is_exact():
    """Cloned per-head k/v (MHA) compute the same function as shared GQA k/v at conversion."""
    teacher = tiny_qwen3()
    mha = convert_model(teacher, [1])
    gqa = convert_model(teacher, [1], rnn_gqa_to_mha=False)
    assert mha.model.layers[0].mixer.k_proj.weight.shape[0] == 4 * 16
    assert gqa.model.layers[0].mixer.k_proj.weight.shape[0] == 2 * 16
    x = torch.randint(0, 256, (2, 33))
    torch.testing.assert_close(logits(mha, x), logits(gqa, x), atol=1e-5, rtol=1e-5)


def test_packed_documents_do_not_interact():
    """A row packing 3 documents (cu_seqlens, per-doc positions) equals 3 separate forwards."""
    student = convert_model(tiny_qwen3(), [0, 2])
    lens = [9, 14, 7]
    docs = [torch.randint(0, 256, (1, n)) for n in lens]
    packed = torch.cat(docs, dim=1)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor([0, 9, 23, 30], dtype=torch.int32)
    out = logits(student, packed, position_ids=pos, cu_seqlens=cu, max_seqlen=14)
    alone = torch.cat([logits(student, d) for d in docs], dim=1)
    torch.testing.assert_close(out, alone, atol=1e-5, rtol=1e-5)
    # positions that restart inside a row mean the same thing without explicit cu_seqlens
    torch.testing.assert_close(logits(student, packed, position_ids=pos), alone, atol=1e-5,
                               rtol=1e-5)


def test_chunked_prefill_then_decode_equals_full_forward():
    student = convert_model(tiny_qwen3(), [1, 3])
    x = torch.randint(0, 256, (2, 41))
    full = logits(student, x)
    cache = HypeNetCache(student.config.num_hidden_layers)
    parts = [logits(student, x[:, :13], cache=cache), logits(student, x[:, 13:30], cache=cache)]
    parts += [logits(student, x[:, t : t + 1], cache=cache) for t in range(30, 41)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-4, rtol=1e-4)


def test_padded_batched_generate_equals_unbatched():
    student = convert_model(tiny_qwen3(), [0, 2])
    prompts = [torch.randint(3, 256, (n,)) for n in (5, 12, 9)]
    assert_left_padded_generate_matches_alone(student, prompts, new_tokens=12, pad_token_id=2)


def test_generate_rejects_right_padding():
    student = convert_model(tiny_qwen3(), [0])
    ids, mask = torch.randint(3, 256, (2, 6)), torch.ones(2, 6, dtype=torch.long)
    mask[0, -2:] = 0
    with pytest.raises(ValueError, match="left padding"):
        student.generate(ids, attention_mask=mask, max_new_tokens=2)


def test_sampling_is_seeded_and_respects_top_k():
    student = convert_model(tiny_qwen3(), [0])
    x = torch.randint(3, 256, (2, 6))
    a = student.generate(x, max_new_tokens=5, do_sample=True, top_k=1, eos_token_id=[])
    greedy = student.generate(x, max_new_tokens=5, eos_token_id=[])
    assert torch.equal(a, greedy)  # top-k 1 sampling is greedy
    samples = []
    for _ in range(2):
        torch.manual_seed(3)
        samples.append(student.generate(x, max_new_tokens=5, do_sample=True, top_p=0.9,
                                        eos_token_id=[]))
    assert torch.equal(*samples)


ABLATIONS = {
    "w/o RNN RoPE": dict(rnn_rope=False),
    "w/ attention RoPE": dict(attn_rope=True),
    "w/o RNN QK-norm": dict(rnn_qk_norm=False),
    "no logits scaling": dict(attn_logits_scale_base=None),
    "no gates": dict(attn_output_gate=False, rnn_output_gate=False),
    "attention output norm": dict(attn_output_norm=True),
}


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_hype_switches_are_configs(name):
    """Each Table-3 ablation is a config that builds, runs, and changes the function."""
    teacher = tiny_qwen3()
    base = convert_model(teacher, [0, 2])
    variant = convert_model(teacher, [0, 2], **ABLATIONS[name])
    x = torch.randint(0, 256, (1, 48))
    out = logits(variant, x)
    assert torch.isfinite(out).all()
    # gates start at exactly 1, so removing them changes nothing at init
    if name not in ("no gates",):
        assert not torch.allclose(out, logits(base, x), atol=1e-6)


def test_logits_scaling_is_one_at_document_start():
    from halo_dist.models.hypenet.layers_hypenet import logits_scale

    s = logits_scale(torch.tensor([[0, 1, 499, 0]]), 500.0).flatten()
    assert s[0].item() == pytest.approx(1.0) and s[3].item() == pytest.approx(1.0)
    assert s[2].item() == pytest.approx(torch.log(torch.tensor(999.0)).item()
                                        / torch.log(torch.tensor(500.0)).item())


def test_activation_checkpointing_gives_same_gradients():
    student = convert_model(tiny_qwen3(), [1])
    student.train()
    x = torch.randint(0, 256, (2, 20))
    grads = []
    for ckpt in (False, True):
        student.model.gradient_checkpointing = ckpt
        student.zero_grad()
        student(x, labels=x).loss.backward()
        grads.append(student.model.layers[0].mixer.q_proj.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


def test_config_rejects_bad_settings():
    with pytest.raises(ValueError, match="mixer_types"):
        HypeNetConfig(num_hidden_layers=2, mixer_types=["attention"])
    with pytest.raises(ValueError, match="unknown"):
        HypeNetConfig(num_hidden_layers=1, mixer_types=["mamba3"])
    with pytest.raises(ValueError, match="divisible"):
        HypeNetConfig(num_attention_heads=6, num_key_value_heads=4, num_hidden_layers=1,
                      mixer_types=["attention"])
    with pytest.raises(ValueError, match="attn_logits_scale_base"):
        HypeNetConfig(attn_logits_scale_base=1.0)


@pytest.mark.slow
def test_export_loads_in_fresh_process_without_halo_dist(tmp_path):
    student = convert_model(tiny_qwen3(tie=True), [0, 3])
    out = export_hypenet(student, tmp_path / "export")
    package = Path(hypenet_package.__file__).parent
    # every model module, exported
    ours = sorted(p.name for p in package.glob("*.py") if p.name != "__init__.py")
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".py") == ours == sorted(MODEL_FILES)
    x = torch.randint(0, 256, (2, 17))
    torch.save(x, tmp_path / "x.pt")
    expected = logits(student, x)
    script = textwrap.dedent(f"""
        import sys
        sys.modules["halo_dist"] = None  # any import of halo_dist now fails
        import torch
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        x = torch.load({str(tmp_path / 'x.pt')!r}, weights_only=True)
        with torch.no_grad():
            torch.save(m(x).logits, {str(tmp_path / 'y.pt')!r})
        print(type(m).__module__)
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "halo_dist" not in res.stdout
    got = torch.load(tmp_path / "y.pt", weights_only=True)
    assert torch.equal(got, expected)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_hypenet.HypeNetForCausalLM"


def test_export_replaces_atomically(tmp_path):
    student = convert_model(tiny_qwen3(), [0])
    target = tmp_path / "m"
    export_hypenet(student, target)
    export_hypenet(student, target, overwrite=True)  # re-export over an earlier export
    assert (target / "model.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_packed_batch_of_several_rows():
    """cu_seqlens over the flattened [B, T] tokens (the loader's layout) with B > 1."""
    student = convert_model(tiny_qwen3(), [0, 2])
    rows = torch.randint(0, 256, (2, 20))
    pos = torch.tensor([list(range(8)) + list(range(12)), list(range(20))])
    cu = torch.tensor([0, 8, 20, 40], dtype=torch.int32)
    out = logits(student, rows, position_ids=pos, cu_seqlens=cu, max_seqlen=20)
    ref = torch.cat([logits(student, rows[:1, :8]), logits(student, rows[:1, 8:])], dim=1)
    torch.testing.assert_close(out[:1], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1:], logits(student, rows[1:]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rms_norm_is_bitwise_the_qwen3_reference(dtype):
    """HypeNetRMSNorm (F.rms_norm: one fused kernel on CUDA) reproduces transformers' Qwen3RMSNorm
    exactly on CPU."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from halo_dist.models.hypenet.layers_hypenet import HypeNetRMSNorm, per_head_rms_norm

    torch.manual_seed(0)
    x = (torch.randn(3, 17, 256) * 5).to(dtype)
    ours, ref = HypeNetRMSNorm(256, 1e-6).to(dtype), Qwen3RMSNorm(256, 1e-6).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(256) + 0.5)
        ours.weight.copy_(ref.weight)
    assert torch.equal(ours(x), ref(x))
    heads = x.view(3, 17, 4, 64)  # per-head norm = Qwen3RMSNorm over each head's 64 dims
    ref_heads = Qwen3RMSNorm(64, 1e-6).to(dtype)
    want = (ref_heads(heads).reshape(3, 17, 256)) * ref.weight
    assert torch.equal(per_head_rms_norm(heads, ref.weight, 1e-6), want)


@pytest.mark.parametrize("scope,checkpointing", [("mlp", False), ("layer", False), ("layer", True)])
def test_compiled_decoder_layers_train_like_eager(scope, checkpointing):
    """model.compile: same loss and gradients as the eager model on a packed batch (fp32, CPU
    Inductor), also under activation checkpointing (its recompute must take the forward's graph)."""
    import copy

    from halo_dist.models.hypenet.modeling_hypenet import compile_decoder_layers

    torch._dynamo.reset()
    student = convert_model(tiny_qwen3(), [1, 3]).float().train()
    compiled = compile_decoder_layers(copy.deepcopy(student), scope)
    compiled.model.gradient_checkpointing = checkpointing
    target = compiled.model.layers[0] if scope == "layer" else compiled.model.layers[0].mlp
    assert target._compiled_call_impl is not None
    x = torch.randint(0, 256, (2, 24))
    pos = torch.cat([torch.arange(10), torch.arange(14), torch.arange(24)]).view(2, 24)
    cu = torch.tensor([0, 10, 24, 48], dtype=torch.int32)
    grads = []
    for model in (student, compiled, compiled):  # twice: a second step reuses the compiled graphs
        model.zero_grad()
        loss = model(x, position_ids=pos, cu_seqlens=cu,
                     max_seqlen=24).logits.float().logsumexp(-1).mean()
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    for loss, g in grads[1:]:
        torch.testing.assert_close(loss, grads[0][0], rtol=1e-5, atol=1e-5)
        for g_compiled, g_eager in zip(g, grads[0][1]):
            torch.testing.assert_close(g_compiled, g_eager, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="none, mlp or layer"):
        compile_decoder_layers(student, "all")
