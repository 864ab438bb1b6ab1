"""`halo-dist import-official`: a folder laid out like the authors' HypeNet checkpoints (their
config keys and weight names, from thunlp/hybrid-linear-attention's
halo/configs/model/hypenet/*.json and halo/modeling/hypenet/*.py) imports into our HypeNet with the
same function, checked against their layer formulas written out here in float64; plus the two config
switches it relies on."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from halo_dist.models.hypenet import HypeNetConfig
from halo_dist.models.hypenet.ops_rnn import lightning_log_decay
from halo_dist.models.official import ImportOfficialError, import_official

V, DM, F, H, HKV, D = 40, 24, 32, 6, 2, 4
MIXERS = ["lightning-attn", "attn", "lightning-attn"]


def their_config(**changes) -> dict:
    """config.json as their HypeNetConfig.save_pretrained writes it (the keys of hypenet-2b.json),
    tiny."""
    cfg = {
        "architectures": ["HypeNetForCausalLM"], "model_type": "hypenet", "attention_bias": False,
        "attention_dropout": 0.0, "attn_logits_scaling": "hype 500", "attn_use_rope": False,
        "attn_use_output_gate": True, "bos_token_id": 1, "eos_token_id": 2, "expand_kv_proj": True,
        "head_dim": D, "hidden_act": "silu", "hidden_size": DM, "initializer_range": 0.02,
        "intermediate_size": F, "lightning_use_rope": True, "lightning_rope_scaling": None,
        "lightning_nh": H, "lightning_nkv": H, "lightning_head_dim": D,
        "lightning_scale": "1/sqrt(d)", "lightning_use_qk_norm": True,
        "lightning_use_output_norm": True, "lightning_use_output_gate": True,
        "lightning_use_short_conv": False, "lightning_conv_size": 4,
        "max_position_embeddings": 4096, "mixer_types": MIXERS, "num_attention_heads": H,
        "num_hidden_layers": len(MIXERS), "num_key_value_heads": HKV, "rms_norm_eps": 1e-6,
        "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "torch_dtype": "float64", "use_cache": True, "vocab_size": V, "loss_fn": "kl_div",
        "rand_init": False, "gdn_use_short_conv": False, "kda_use_rope": False,
    }
    cfg.update(changes)
    return cfg


def their_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float64 weights under their module names (norm weights near 1, so each one
    matters)."""
    g = torch.Generator().manual_seed(seed)
    lin = (lambda o, i: torch.randn(o, i, generator=g, dtype=torch.float64)  # noqa: E731
           / math.sqrt(i))
    norm = lambda n: 0.5 + torch.rand(n, generator=g, dtype=torch.float64)  # noqa: E731
    nkv = cfg["lightning_nkv"]
    w = {"model.embed_tokens.weight": torch.randn(V, DM, generator=g, dtype=torch.float64),
         "model.norm.weight": norm(DM)}
    for i, kind in enumerate(cfg["mixer_types"]):
        p = f"model.layers.{i}."
        kv = HKV if kind == "attn" else nkv
        w.update({p + "input_layernorm.weight": norm(DM),
                  p + "post_attention_layernorm.weight": norm(DM),
                  p + "mlp.gate_proj.weight": lin(F, DM), p + "mlp.up_proj.weight": lin(F, DM),
                  p + "mlp.down_proj.weight": lin(DM, F),
                  p + "self_attn.q_proj.weight": lin(H * D, DM),
                  p + "self_attn.k_proj.weight": lin(kv * D, DM),
                  p + "self_attn.v_proj.weight": lin(kv * D, DM),
                  p + "self_attn.o_proj.weight": lin(DM, H * D),
                  p + "self_attn.q_norm.weight": norm(D), p + "self_attn.k_norm.weight": norm(D)})
        if kind == "attn":
            w[p + "self_attn.o_gate.weight"] = lin(H * D, DM)
        else:
            w[p + "self_attn.o_norm.weight"] = norm(H * D)
            w[p + "self_attn.z_proj.weight"] = lin(H * D, DM)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = lin(V, DM)
    return w


def write_folder(path, cfg, weights):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(weights, str(path / "model.safetensors"))
    return path


# -------------------------------------------------------------------------- their formulas, float64
def rms(x, w, eps=1e-6):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def rope(x, pos, theta):
    """x [T, h, D]: rotate-half RoPE with inv_freq_i = theta^(-2i/D)."""
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos[:, None].double() * inv  # [T, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def their_logits(cfg: dict, w: dict, ids: torch.Tensor, slopes: list[float]) -> torch.Tensor:
    """One sequence [T] through their HypeNetForCausalLM, written as math: Qwen3Attention with q/k
    norms, optional RoPE, queries times ln(t + a)/ln(a), GQA softmax attention, sigmoid(o_gate)
    output gate;
    LightningAttention with q/k norms, RoPE, S_t = exp(-slope_h) S_{t-1} + k_t^T v_t, o_t = q_t S_t
    / sqrt(D), one RMSNorm over all heads, sigmoid(z_proj) gate."""
    T = ids.shape[0]
    pos = torch.arange(T)
    x = w["model.embed_tokens.weight"][ids]
    a = float(cfg["attn_logits_scaling"].split()[1]) if cfg["attn_logits_scaling"] else None
    for i, kind in enumerate(cfg["mixer_types"]):
        p = f"model.layers.{i}."
        W = lambda n: w[p + "self_attn." + n]  # noqa: E731
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rms((h @ W("q_proj.weight").T).view(T, H, D), W("q_norm.weight"))
        k = rms((h @ W("k_proj.weight").T).view(T, -1, D), W("k_norm.weight"))
        v = (h @ W("v_proj.weight").T).view(T, -1, D)
        if (kind == "attn" and cfg["attn_use_rope"]) or (kind != "attn"
                                                         and cfg["lightning_use_rope"]):
            q, k = rope(q, pos, cfg["rope_theta"]), rope(k, pos, cfg["rope_theta"])
        k, v = k.repeat_interleave(H // k.shape[1], 1), v.repeat_interleave(H // v.shape[1], 1)
        if kind == "attn":
            if a is not None:
                q = q * (torch.log(pos + a) / math.log(a))[:, None, None]
            s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(D)
            s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
            o = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, H * D)
            o = o * torch.sigmoid(h @ W("o_gate.weight").T)
        else:
            state, outs = torch.zeros(H, D, D, dtype=torch.float64), []
            gamma = torch.exp(-torch.tensor(slopes, dtype=torch.float64))[:, None, None]
            for t in range(T):
                state = gamma * state + k[t][:, :, None] * v[t][:, None, :]  # [H, Dk, Dv]
                outs.append(torch.einsum("hk,hkv->hv", q[t], state) / math.sqrt(D))
            o = rms(torch.stack(outs).reshape(T, H * D), W("o_norm.weight"))
            o = o * torch.sigmoid(h @ W("z_proj.weight").T)
        x = x + o @ W("o_proj.weight").T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        mlp = lambda n: w[p + "mlp." + n]  # noqa: E731
        x = x + (torch.nn.functional.silu(h @ mlp("gate_proj.weight").T)
                 * (h @ mlp("up_proj.weight").T)) @ mlp("down_proj.weight").T
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return rms(x, w["model.norm.weight"]) @ head.T


# ALiBi's get_slopes for 6 heads: the 4-head slopes 2^-2, 2^-4, 2^-6, 2^-8, then every other 8-head
# slope (2^-1, 2^-3, ...) for the 2 heads left
SLOPES_6 = [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("changes", [{}, dict(lightning_nkv=HKV, tie_word_embeddings=False,
                                              attn_logits_scaling="hype", attn_use_rope=True)])
def test_imported_checkpoint_matches_their_formulas_in_float64(tmp_path, changes):
    """GQA-to-MHA Lightning layers (their released configs) and GQA kept, tied and untied heads, the
    logits-scaling string with and without its base (362 then), NoPE and RoPE attention."""
    from transformers import AutoModelForCausalLM

    cfg = their_config(**changes)
    w = their_weights(cfg)
    folder = write_folder(tmp_path / "theirs", cfg, w)
    model = import_official(folder, tmp_path / "ours")
    c = model.config
    assert ((c.rnn_output_norm, c.lightning_decay, c.output_gate_scale)
            == ("all_heads", "alibi", 1.0))
    assert c.mixer_types == ["lightning", "attention", "lightning"]
    assert (c.attn_logits_scale_base == (500.0 if not changes else 362.0)
            and c.rnn_gqa_to_mha == (not changes))
    assert next(model.parameters()).dtype == torch.float64
    # > one 64-token chunk
    ids = torch.randint(0, V, (2, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids).logits
    if changes:
        # what their code reads from a string without a base
        cfg["attn_logits_scaling"] = "hype 362"
    for row in range(2):
        ref = their_logits(cfg, w, ids[row], SLOPES_6)
        assert ((ours[row] - ref).abs().max() <= 1e-6
                * ref.abs().max()), (ours[row] - ref).abs().max()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", trust_remote_code=True,
                                                    dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, ours)  # the export's own files carry both switches


def test_alibi_decays_interleave_and_equal_ours_for_powers_of_two():
    # ALiBi's slopes for 9 heads (the SmolLM2 student): 8-head slopes 2^-1..2^-8, then 2^-0.5
    nine = [2.0 ** -h for h in range(1, 9)] + [2 ** -0.5]
    torch.testing.assert_close(lightning_log_decay(9, decay="alibi"),
                               -torch.tensor(nine, dtype=torch.float32))
    torch.testing.assert_close(lightning_log_decay(6, decay="alibi"),
                               -torch.tensor(SLOPES_6, dtype=torch.float32))
    for n in (4, 8, 16, 32, 64):
        assert torch.equal(lightning_log_decay(n, decay="alibi"), lightning_log_decay(n))
    assert not torch.allclose(lightning_log_decay(9, decay="alibi"), lightning_log_decay(9))
    # ours
    assert ((HypeNetConfig().rnn_output_norm, HypeNetConfig().lightning_decay)
            == ("per_head", "hype"))
    for key in ("rnn_output_norm", "lightning_decay"):
        with pytest.raises(ValueError, match=f"{key}='x' is unknown"):
            HypeNetConfig(**{key: "x"})


@pytest.mark.parametrize("changes,match", [
    (dict(lightning_use_short_conv=True), "lightning_use_short_conv=True: .*no short convolution"),
    (dict(lightning_scale="1/d"), "lightning_scale='1/d'"),
    (dict(attn_logits_scaling=0.8), "attn_logits_scaling=0.8: a constant query scale"),
    (dict(attn_logits_scaling="hype big"), "second word must be the base"),
    (dict(mixer_types=["gdn", "attn", "lightning-attn"]), r"\['gdn'\] have no HypeNet counterpart"),
    (dict(lightning_nkv=3), "lightning_nkv=3"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
])
def test_settings_hypenet_cannot_express_are_refused_before_the_weights(tmp_path, changes, match):
    folder = tmp_path / "theirs"
    folder.mkdir()
    # no weights: never read
    (folder / "config.json").write_text(json.dumps(their_config(**changes)))
    with pytest.raises(ImportOfficialError, match=match):
        import_official(folder)


def test_weights_that_do_not_fit_are_named_and_the_cli_says_so_in_one_line(tmp_path, capsys):
    from halo_dist.cli import main

    cfg = their_config()
    w = their_weights(cfg)
    w["model.layers.0.self_attn.q_conv1d.weight"] = torch.zeros(1)
    del w["model.layers.1.self_attn.o_gate.weight"]
    write_folder(tmp_path / "theirs", cfg, w)
    with pytest.raises(ImportOfficialError,
                       match=r"no place in HypeNet: \['model.layers.0.self_attn.q_conv1d"):
        import_official(tmp_path / "theirs")
    assert (main(["import-official", str(tmp_path / "theirs"), "--output", str(tmp_path / "out")])
            == 2)
    err = capsys.readouterr().err
    assert "error: " in err and "weights missing: ['model.layers.1.mixer.g_proj.weight']" in err
    assert not (tmp_path / "out").exists()
    ours = tmp_path / "ours_export"
    write_folder(ours, {**their_config(), "rnn_output_norm": "per_head"}, {})
    assert main(["import-official", str(ours), "--output", str(tmp_path / "out")]) == 2
    assert "already a halo_dist HypeNet" in capsys.readouterr().err


def test_the_output_may_not_be_their_folder_nor_hold_it(tmp_path, capsys):
    """`import-official DIR --output DIR` replaced their checkpoint with ours."""
    from halo_dist.cli import main

    cfg = their_config()
    folder = write_folder(tmp_path / "theirs", cfg, their_weights(cfg))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for output in (folder, tmp_path):
        for extra in ([], ["--overwrite"]):
            assert main(["import-official", str(folder), "--output", str(output), *extra]) == 2
            errors = [line for line in capsys.readouterr().err.splitlines()
                      if line.startswith("error:")]
            assert len(errors) == 1 and "checkpoint folder" in errors[0], errors
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
