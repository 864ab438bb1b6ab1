"""The sweep mixers: GDN, GLA, RWKV-7, Mamba2 and sliding-window attention.

Kernels: every chunked torch form equals its naive recurrence in float64, with initial states and
packed documents, gradients included; the recurrences are cross-checked against each other (Mamba2
is GLA with a per-head decay, GDN is a DPLR recurrence). Mixers: packed == separate documents,
chunked prefill + step decode == full forward, every parameter gets a gradient, and a tiny HypeNet
trains / generates (left-padded batches equal single rows). SWA equals an explicit masked softmax.
Ulysses SP=2 equals SP=1 (forward, input and parameter gradients) on 2 gloo ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_left_padded_generate_matches_alone
from distributed import run_distributed
from halo_dist.models.hypenet import HypeNetCache, HypeNetConfig, HypeNetForCausalLM
from halo_dist.models.hypenet import ops_rnn as ops
from halo_dist.models.hypenet import ops_rnn_torch as ref
from halo_dist.models.hypenet.layers_hypenet import SequenceInfo
from halo_dist.models.hypenet.modeling_hypenet import MIXER_CLASSES

F64 = torch.float64
RNNS = ["gdn", "gla", "rwkv7", "mamba2"]
NEW = RNNS + ["swa"]


def rand(*shape, seed=0, dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def inputs(kind: str, B=2, T=19, H=2, K=8, V=8, seed=0):
    """Random kernel inputs of one recurrence: (q, k, v, *gates) in float64."""
    q, k, v = (rand(B, T, H, K, seed=seed), rand(B, T, H, K, seed=seed + 1),
               rand(B, T, H, V, seed=seed + 2))
    if kind == "gla":
        return q, k, v, -torch.rand(B, T, H, K, dtype=F64,
                                    generator=torch.Generator().manual_seed(seed + 3))
    if kind == "mamba2":
        return q, k, v, -torch.rand(B, T, H, dtype=F64,
                                    generator=torch.Generator().manual_seed(seed + 3))
    if kind == "gdn":
        k = torch.nn.functional.normalize(k, dim=-1)
        g = -torch.rand(B, T, H, dtype=F64, generator=torch.Generator().manual_seed(seed + 3))
        return q, k, v, g, torch.rand(B, T, H, dtype=F64,
                                      generator=torch.Generator().manual_seed(seed + 4))
    kk = torch.nn.functional.normalize(rand(B, T, H, K, seed=seed + 3), dim=-1)
    a = torch.rand(B, T, H, K, dtype=F64, generator=torch.Generator().manual_seed(seed + 4))
    w = ops.RWKV7_LOG_DECAY_MIN * torch.rand(B, T, H, K, dtype=F64,
                                             generator=torch.Generator().manual_seed(seed + 5))
    return q, k, v, w, -kk, kk * a


NAIVE = {
    "gla": lambda q, k, v, gk, s, init: ref.gla_recurrent_torch(q, k, v, gk, s, init),
    "mamba2": lambda q, k, v, g, s, init: ref.lightning_recurrent_torch(q, k, v, g, s, init),
    "gdn": lambda q, k, v, g, b, s, init: ref.gdn_recurrent_torch(q, k, v, g, b, s, init),
    "rwkv7": lambda q, k, v, w, a, b, s, init: ref.dplr_recurrent_torch(q, k, v, a, b, w, s, init),
}
DISPATCH = {"gla": ops.gla_attention, "mamba2": ops.mamba2_attention,
            "gdn": ops.gated_delta_attention, "rwkv7": ops.rwkv7_attention}


# --- kernels --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gla", "mamba2", "gdn"])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_equals_naive_recurrence(kind, chunk):
    x = inputs(kind)
    init = rand(2, 2, 8, 8, seed=9)
    o_ref, s_ref = NAIVE[kind](*x, 0.3, init)
    o, s = DISPATCH[kind](*x, 0.3, initial_state=init, chunk_size=chunk)
    assert (o - o_ref).abs().max() <= 1e-10 and (s - s_ref).abs().max() <= 1e-10
    assert o.dtype == F64 and s.dtype == F64


@pytest.mark.parametrize("kind", RNNS)
def test_packed_documents_reset_state(kind):
    x = inputs(kind, B=1, T=23, seed=3)
    cu = torch.tensor([0, 6, 17, 23], dtype=torch.int32)
    init = rand(3, 2, 8, 8, seed=4)
    o, s = DISPATCH[kind](*x, 0.5, initial_state=init, cu_seqlens=cu, chunk_size=4)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_ref, s_ref = NAIVE[kind](*(t[:, a:b] for t in x), 0.5, init[n : n + 1])
        assert (o[:, a:b] - o_ref).abs().max() <= 1e-10
        assert (s[n : n + 1] - s_ref).abs().max() <= 1e-10


@pytest.mark.parametrize("kind", ["gla", "gdn"])
def test_chunked_gradients_match_naive(kind):
    x = [t.requires_grad_() for t in inputs(kind, B=1, T=13, seed=5)]
    w = rand(1, 13, 2, 8, seed=6)
    grads = []
    for fn in (lambda: NAIVE[kind](*x, 0.3, None)[0],
               lambda: DISPATCH[kind](*x, 0.3, chunk_size=4)[0]):
        grads.append(torch.autograd.grad((fn() * w).sum(), x))
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= 1e-10


def test_recurrences_agree_with_each_other():
    """Mamba2 = GLA with the decay broadcast over K; GDN = DPLR with k' = βk, a = k, b = -αβk."""
    q, k, v, g = inputs("mamba2", seed=7)
    o1, s1 = ref.lightning_recurrent_torch(q, k, v, g, 0.4)
    o2, s2 = ref.gla_recurrent_torch(q, k, v, g[..., None].expand_as(q), 0.4)
    assert (o1 - o2).abs().max() <= 1e-12 and (s1 - s2).abs().max() <= 1e-12
    q, k, v, g, beta = inputs("gdn", seed=8)
    o1, s1 = ref.gdn_recurrent_torch(q, k, v, g, beta, 0.4)
    alpha = g.exp()[..., None]
    o2, s2 = ref.dplr_recurrent_torch(q, beta[..., None] * k, v, k, -alpha * beta[..., None] * k,
                                      g[..., None].expand_as(k), 0.4)
    assert (o1 - o2).abs().max() <= 1e-12 and (s1 - s2).abs().max() <= 1e-12


def test_long_gla_chunk_does_not_overflow():
    q, k, v, gk = inputs("gla", B=1, T=200, seed=9)
    gk = gk * 8  # strong decays: exp(-G) alone would overflow a 200-token chunk
    o, _ = ref.gla_chunk_torch(q.float(), k.float(), v.float(), gk.float(), 1.0, chunk_size=200)
    o_ref, _ = ref.gla_recurrent_torch(q, k, v, gk, 1.0)
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o.double(), o_ref, atol=1e-4, rtol=1e-4)


def test_no_fallback_off_hopper():
    x = rand(1, 2, 1, 4).requires_grad_()
    assert not ops.gated_backward_fallback(x)  # CPU tensors never need the Hopper fallback


# --- mixers ---------------------------------------------------------------------------------------

def tiny_config(mixer: str, **over) -> HypeNetConfig:
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              mixer_types=["attention", mixer], rope_theta=100.0, attn_logits_scale_base=8.0,
              lightning_chunk_size=4, sliding_window=5)
    kw.update(over)
    return HypeNetConfig(**kw)


def randomise(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Seeded random weights (1-D ones near 1), so no gate, bonus or skip term is trivial."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=F64).to(p.dtype)
            p.copy_(0.3 * noise if p.dim() > 1 else 1.0 + 0.1 * noise)
    return module


def build_mixer(kind: str, seed: int = 0, **over):
    return randomise(MIXER_CLASSES[kind](tiny_config(kind, **over), layer_idx=1).to(F64), seed)


def tiny_model(kind: str, seed: int = 0, **over) -> HypeNetForCausalLM:
    torch.manual_seed(seed)
    model = HypeNetForCausalLM(tiny_config(kind, **over)).to(F64).eval()
    return randomise(model, seed)


@pytest.mark.parametrize("kind", NEW)
def test_mixer_packed_equals_separate(kind):
    mixer = build_mixer(kind)
    lens = [4, 9, 7]
    x = rand(1, 20, 32, seed=1)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor([0, 4, 13, 20], dtype=torch.int32)
    with torch.no_grad():
        out = mixer(x, SequenceInfo(pos, cu, 9))
        alone = [mixer(x[:, a:b], SequenceInfo(torch.arange(b - a)[None]))
                 for a, b in ((0, 4), (4, 13), (13, 20))]
    assert (out - torch.cat(alone, dim=1)).abs().max() <= 1e-10


@pytest.mark.parametrize("kind", NEW)
def test_prefill_and_decode_equal_full_forward(kind):
    model = tiny_model(kind)
    x = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(x).logits
        cache = HypeNetCache(model.config.num_hidden_layers)
        # 18 > 16: chunked
        parts = [model(x[:, :7], cache=cache).logits, model(x[:, 7:25], cache=cache).logits]
        parts += [model(x[:, t : t + 1], cache=cache).logits for t in range(25, 30)]
    assert (torch.cat(parts, dim=1) - full).abs().max() <= 1e-9
    if kind == "swa":  # the window's cache holds the last W - 1 = 4 keys only
        assert cache.layers[1][0].shape[1] == 4


@pytest.mark.parametrize("kind", NEW)
def test_every_parameter_gets_gradient(kind):
    model = tiny_model(kind)
    model.train()
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    model(x, labels=x).loss.backward()
    for name, p in model.model.layers[1].mixer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("kind", NEW)
def test_tiny_hypenet_trains_and_generates_padded_batches(kind):
    """Fresh init (HF post_init incl. the mixers' own parameters), a training step, then left-padded
    batched greedy generation equals per-row generation."""
    torch.manual_seed(0)
    model = HypeNetForCausalLM(tiny_config(kind, pad_token_id=0))
    mixer = model.model.layers[1].mixer
    # torch.empty until _init_weights fills them
    for name in ("A_log", "dt_bias", "D", "k_k", "k_a", "r_k"):
        if hasattr(mixer, name):
            assert (torch.isfinite(getattr(mixer, name)).all()
                    and getattr(mixer, name).abs().max() < 20), name
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(1, 64, (2, 16))
    loss0 = model(x, labels=x).loss
    loss0.backward()
    opt.step()
    assert torch.isfinite(loss0)
    model = randomise(model.to(F64).eval(), 4)
    prompts = [torch.randint(1, 64, (n,), generator=torch.Generator().manual_seed(n))
               for n in (3, 8, 6)]
    assert_left_padded_generate_matches_alone(model, prompts, new_tokens=6, pad_token_id=0)


# --- sliding-window attention ---------------------------------------------------------------------

def reference_swa(mixer, x, pos, doc, window):
    """Explicit masked softmax: query i sees key j iff same document, j <= i and i - j < window."""
    q, k, v, _ = mixer.project(x, SequenceInfo(pos))
    g = mixer.num_heads // mixer.num_kv_heads
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * mixer.head_dim**-0.5
    i, j = torch.arange(x.shape[1])[:, None], torch.arange(x.shape[1])[None]
    allowed = (j <= i) & (i - j < window) & (doc[:, :, None] == doc[:, None, :])[:, None]
    o = torch.einsum("bhij,bjhd->bihd", s.masked_fill(~allowed, float("-inf")).softmax(-1), v)
    return mixer.finish(o, x)


@pytest.mark.parametrize("window", [1, 3, 6, 40])
@pytest.mark.parametrize("rope", [True, False])
def test_swa_equals_masked_softmax(window, rope):
    mixer = build_mixer("swa", sliding_window=window, swa_rope=rope)
    x = rand(2, 21, 32, seed=5)
    pos = torch.arange(21)[None].expand(2, -1)
    with torch.no_grad():
        got = mixer(x, SequenceInfo(pos))
        want = reference_swa(mixer, x, pos, torch.zeros(2, 21, dtype=torch.long), window)
        assert (got - want).abs().max() <= 1e-10
        # packed: row 0 holds documents of 8 and 13 tokens, row 1 one of 21
        pos_p = torch.stack([torch.cat([torch.arange(8), torch.arange(13)]), torch.arange(21)])
        doc = torch.stack([torch.cat([torch.zeros(8), torch.ones(13)]),
                           torch.full((21,), 2.0)]).long()
        cu = torch.tensor([0, 8, 21, 42], dtype=torch.int32)
        got = mixer(x, SequenceInfo(pos_p, cu, 21))
        assert (got - reference_swa(mixer, x, pos_p, doc, window)).abs().max() <= 1e-10


def test_swa_rope_switch_and_no_logits_scaling():
    a, b = build_mixer("swa", swa_rope=True), build_mixer("swa", swa_rope=False)
    x, pos = rand(1, 9, 32, seed=6), torch.arange(9)[None]
    with torch.no_grad():
        assert not torch.allclose(a(x, SequenceInfo(pos)), b(x, SequenceInfo(pos)))
        q, *_ = b.project(x, SequenceInfo(pos))
        q_ref = b.q_norm(b.q_proj(x).view(1, 9, 4, 8))
        assert torch.equal(q, q_ref)  # no RoPE and no logits scaling on q


# --- config ---------------------------------------------------------------------------------------

def test_config_validation():
    with pytest.raises(ValueError, match=r"mixer_types\[1\]='mamba3' is unknown"):
        tiny_config("mamba3")
    for bad in (0, -4, 2.5, True, "512"):
        with pytest.raises(ValueError, match="sliding_window"):
            tiny_config("swa", sliding_window=bad)
    with pytest.raises(ValueError, match="sliding_window is None"):
        tiny_config("swa", sliding_window=None)
    tiny_config("gdn", sliding_window=None)  # no SWA layer: no window needed
    cfg = HypeNetConfig.from_dict(tiny_config("swa", sliding_window=512, swa_rope=False).to_dict())
    assert (cfg.sliding_window == 512 and cfg.swa_rope is False
            and cfg.mixer_types == ["attention", "swa"])


# --- Ulysses sequence parallelism (2 gloo ranks) --------------------------------------------------

SP_KINDS = {f"{k}": (k, {}) for k in NEW}
SP_KINDS["gdn_gqa_kept"] = ("gdn", {"rnn_gqa_to_mha": False, "rnn_rope": False})
SP_KINDS["swa_kv1"] = ("swa", {"num_key_value_heads": 1, "sliding_window": 3})


def _sp_scenarios() -> dict:
    import torch.distributed as dist

    from sp_golden import (CAUSAL, PACKED, apply_sp_to_model, golden, mixer_forward, model_forward,
                           set_mixer_sp)
    from halo_dist.parallel import SequenceParallel

    torch.set_num_threads(1)
    sp = SequenceParallel(dist.group.WORLD)
    res = {}
    for i, (name, (kind, over)) in enumerate(SP_KINDS.items()):
        mixer = build_mixer(kind, seed=100 + i, **over)
        for j, (lname, layout) in enumerate((("causal", CAUSAL), ("packed", PACKED))):
            res[f"{name}/{lname}"] = golden(sp, mixer, mixer_forward, layout, seed=10 * i + j,
                                            inject=set_mixer_sp)
    model = tiny_model("gdn", num_hidden_layers=6,
                       mixer_types=["attention", "gdn", "gla", "rwkv7", "mamba2", "swa"])
    for j, (lname, layout) in enumerate((("causal", CAUSAL), ("packed", PACKED))):
        res[f"model/{lname}"] = golden(sp, model, model_forward, layout, seed=90 + j,
                                       inject=apply_sp_to_model)
    return res


@pytest.fixture(scope="module")
def sp_results():
    return run_distributed(_sp_scenarios, world_size=2, timeout=150, collective_timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("case", [f"{n}/{lay}" for n in [*SP_KINDS, "model"]
                                  for lay in ("causal", "packed")])
@pytest.mark.slow
def test_sp2_matches_single_process(sp_results, case):
    for rank, res in enumerate(sp_results):
        r = res[case]
        assert r["grad_scale"] > 1e-3, (rank, case, r)
        assert max(r["out"], r["grad_x"], r["grad_params"]) <= 1e-10, (rank, case, r)


def test_indivisible_heads_raise_before_communication():
    class NoCommSP:
        world_size, rank, group = 2, 0, None

        def seq_to_head(self, x):
            raise AssertionError("communication attempted")

        head_to_seq = seq_to_head

    for kind in NEW:
        mixer = build_mixer(kind, num_attention_heads=3, num_key_value_heads=1)
        mixer.sp = NoCommSP()
        with pytest.raises(ValueError, match="sp_size=2"):
            mixer(rand(1, 2, 32), SequenceInfo(torch.arange(2)[None]))


# --- conversion with another replacement mixer (convert.py rnn_mixer) -----------------------------

@pytest.mark.parametrize("kind", NEW)
def test_convert_with_rnn_mixer(kind):
    from conftest import tiny_qwen3
    from halo_dist.models.convert import convert_model

    teacher = tiny_qwen3()
    student = convert_model(teacher, [0, 2], rnn_mixer=kind, attn_rope=True,
                            attn_logits_scale_base=None, sliding_window=64)
    assert student.config.mixer_types == ["attention", kind, "attention", kind]
    mixer, src = student.model.layers[1].mixer, teacher.model.layers[1].self_attn
    assert torch.equal(mixer.q_proj.weight, src.q_proj.weight) and torch.equal(mixer.o_proj.weight,
                                                                               src.o_proj.weight)
    # RNN heads get their own W_k (GQA -> MHA), SWA keeps the teacher's
    g = 1 if kind == "swa" else 2
    assert torch.equal(mixer.k_proj.weight,
                       src.k_proj.weight.view(2, 16, 64).repeat_interleave(g, 0).reshape(-1, 64))
    x = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        out = student(x).logits
    assert torch.isfinite(out).all()
    if kind == "swa":  # a window longer than the text with RoPE is the teacher's attention exactly
        with torch.no_grad():
            assert (out - teacher(x).logits).abs().max() <= 1e-4
    again = convert_model(teacher, [0, 2], rnn_mixer=kind, sliding_window=64)
    for (name, a), b in zip(student.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name  # conversion is deterministic (fresh gates seeded per layer)


def test_convert_rejects_unknown_rnn_mixer():
    from conftest import tiny_qwen3
    from halo_dist.models.convert import ConversionError, convert_model

    with pytest.raises(ConversionError, match="rnn_mixer='mamba3'"):
        convert_model(tiny_qwen3(), [0], rnn_mixer="mamba3")


@pytest.mark.slow
def test_a_process_without_a_gpu_does_not_import_fla():
    """fla's kernels run only on CUDA tensors and its import takes ~3.5 s: a CPU process (a test
    rank, a launcher refusing a config, the CPU demo) that imports the model and the engine must not
    pay it."""
    script = ("import sys, halo_dist.registry, halo_dist.models.hypenet\n"
              "print(sorted(m for m in sys.modules if m == 'fla' or m.startswith('fla.')))")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]", res.stdout[-500:]
