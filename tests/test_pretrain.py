"""From-scratch pretraining (stage ``pretrain``): launcher runs, exact resume, init and
weight-decay groups, the sweep variants as HypeNet configs, clear config errors, the benchmark's CPU
smoke mode.

The launcher runs use tiny shapes on real Wikipedia shards in the tiny configs' 4,096-token BPE
vocabulary (configs/tiny/pretrain_*.yaml).
"""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from stage_runs import losses, rewrite_in_checkpoint, run_launcher

from halo_dist.config import load_config
from halo_dist.launch import launch_pretrain
from halo_dist.models.hypenet.modeling_hypenet import MIXER_CLASSES
from halo_dist.stages.pretrain import (build_pretrain_model, hypenet_kwargs, param_groups,
                                       train_flops_per_token, unique_numel)
from halo_dist.registry import stage_spec

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny"
SWEEPS = REPO / "configs" / "sweeps"
sys.path.insert(0, str(REPO / "slurm"))
import sweep_variants  # noqa: E402

GRID = sweep_variants.load_grid(SWEEPS / "grid.yaml")[1]
# shrink the 500M base to a CPU shape, keeping every variant's own overrides
TINY_SHAPE = ["pretrain.model.vocab_size=97", "pretrain.model.num_hidden_layers=8",
              "pretrain.model.hidden_size=32", "pretrain.model.intermediate_size=64",
              "pretrain.model.num_attention_heads=4", "pretrain.model.num_key_value_heads=2",
              "pretrain.model.head_dim=8", "model.dtype=float32",
              "model.activation_checkpointing=false", "pretrain.model.tokenizer=null"]


def pretrain(run_dir, config, *overrides, **kw):
    return run_launcher("pretrain", run_dir, *overrides, config=TINY / f"pretrain_{config}.yaml",
                        **kw)


# --------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_transformer_trains_and_exports(shards, tmp_path):
    run_dir = tmp_path / "tf"
    pretrain(run_dir, "transformer", f"data.train={shards}", "schedule.total_steps=6",
             "checkpoint.every_steps=0")
    curve = losses(run_dir)
    # CE over 4,096 tokens starts near the uniform ln(4096) = 8.32 (init std 0.02: near-zero logits)
    assert (len(curve) == 6 and curve[0] > math.log(4096) - 0.93
            and curve[-1] < curve[0] - 0.3), curve
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final", trust_remote_code=True)
    cfg = model.config
    assert (cfg.mixer_types == ["attention"] * 4 and cfg.attn_rope
            and cfg.attn_logits_scale_base is None)
    assert cfg.rope_theta == 50_000.0 and not cfg.attn_output_gate
    record = json.loads((run_dir / "final" / "DONE").read_text())
    assert (record["stage"] == "pretrain" and record["step"] == 6 and record["tokens"] > 0
            and "history" not in record)
    assert json.loads((run_dir / "final" / "halo_dist.json").read_text()) == record
    assert model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2).shape == (1, 5)


@pytest.mark.slow
def test_hypenet_trains_and_resumes_exactly_after_a_crash(shards, tmp_path):
    common = [f"data.train={shards}", "schedule.total_steps=6", "checkpoint.every_steps=2"]
    pretrain(tmp_path / "straight", "hypenet", *common)
    straight = losses(tmp_path / "straight")
    assert len(straight) == 6 and straight[-1] < straight[0] - 0.3, straight
    # a hard crash after step 3 (no cleanup): step 2 is the last checkpoint
    crashed = tmp_path / "crashed"
    pretrain(crashed, "hypenet", *common, faults=dict(crash_at=3), expect=17)
    assert sorted(p.name for p in (crashed / "checkpoints").glob("step-*")) == ["step-00000002"]
    res = pretrain(crashed, "hypenet", *common)  # the restarted launcher resumes by itself
    assert "resumed from" in res.stdout and "step 2" in res.stdout
    resumed = losses(crashed)
    assert len(resumed) == 6
    for a, b in zip(straight, resumed):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (straight, resumed)
    exported = json.loads((crashed / "final" / "config.json").read_text())
    assert exported["mixer_types"] == ["attention", "lightning", "lightning", "lightning"]
    assert (exported["attn_logits_scale_base"] == 300.0 and exported["rnn_rope"]
            and not exported["attn_rope"])


@pytest.mark.slow
def test_zero3_resume_on_another_number_of_ranks_is_refused(shards, tmp_path):
    """Pretraining's AdamW has two groups (decay / no_decay): DeepSpeed's ZeRO-3 re-partitioning
    would give both the first one's weight decay and one shared Adam step, so a ZeRO-3 checkpoint of
    another number of ranks is refused before anything is built, naming both numbers (ZeRO 0-2
    re-partition exactly)."""
    common = [f"data.train={shards}", "schedule.total_steps=6", "checkpoint.every_steps=2",
              "parallel.zero_stage=3"]
    # step 2 is the last checkpoint
    pretrain(tmp_path, "hypenet", *common, faults=dict(crash_at=3), expect=17)
    state_file = tmp_path / "checkpoints" / "step-00000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["world_size"] == 1
    # as if written by a 2-rank job
    rewrite_in_checkpoint(state_file,
                          lambda p: p.write_text(json.dumps({**state, "world_size": 2})))
    res = pretrain(tmp_path, "hypenet", *common, expect=2)
    assert ("written on 2 rank(s); this run has 1: stage pretrain under "
            "ZeRO-3" in res.stderr), res.stderr[-2000:]
    assert "Resume on 2 rank(s)" in res.stderr


@pytest.mark.slow
def test_shards_beyond_the_model_vocabulary_are_refused_before_training(shards, tmp_path):
    """Shards of the 4,096-token tiny BPE for a 97-token scratch model: one error line
    naming both sizes, before any model or optimizer exists (not an IndexError at step 1)."""
    res = pretrain(tmp_path, "hypenet", f"data.train={shards}", "pretrain.model.vocab_size=97",
                   expect=2)
    assert ("error:" in res.stderr and "vocabulary" in res.stderr
            and "97" in res.stderr), res.stderr[-2000:]
    assert "Traceback" not in res.stderr and not (tmp_path / "checkpoints").exists()


# ------------------------------------------------------------------------------------------ model
def test_init_and_weight_decay_groups():
    cfg = load_config(TINY / "pretrain_hypenet.yaml",
                      ["pretrain.model.hidden_size=256", "pretrain.model.head_dim=64",
                       "pretrain.model.intermediate_size=512",
                       "pretrain.model.vocab_size=4096"])
    before = torch.random.get_rng_state()
    model = build_pretrain_model(cfg)
    assert torch.equal(before, torch.random.get_rng_state()), "init must not consume the global RNG"
    again = build_pretrain_model(cfg)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 again.state_dict().values()))
    layers, std = 4, 0.02
    weight = dict(model.named_parameters())
    for name in ("model.embed_tokens.weight", "model.layers.0.mixer.q_proj.weight",
                 "model.layers.1.mixer.k_proj.weight", "model.layers.2.mlp.up_proj.weight"):
        assert abs(weight[name].std().item() / std - 1) < 0.05, name
    for name in ("model.layers.0.mixer.o_proj.weight", "model.layers.3.mlp.down_proj.weight"):
        assert abs(weight[name].std().item() / (std / math.sqrt(2 * layers)) - 1) < 0.05, name
    assert weight["model.layers.0.mixer.g_proj.weight"].abs().max() == 0  # gates start at exactly 1
    assert weight["model.layers.1.mixer.g_proj.weight"].abs().max() == 0
    assert torch.equal(weight["model.norm.weight"], torch.ones(256))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied

    # the registered stage: CE module, no teacher
    module, teacher = stage_spec(cfg.stage.name).build(cfg)
    assert teacher is None and module.objective == "ce"
    batch = {"input_ids": torch.zeros(2, 5, dtype=torch.long),
             "labels": torch.tensor([[1, 2, -100, 3, -100]] * 2)}
    # labelled tokens
    assert module.loss_tokens(batch) == 6 and module.student_config is module.student.config
    decay, no_decay = param_groups(module, 0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    names = {id(p): n for n, p in module.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert "student.model.embed_tokens.weight" in kept  # the embedding (= tied lm_head)
    assert all(n.endswith("norm.weight") or "embed" in n for n in kept), kept
    assert all(n.endswith("proj.weight") for n in decayed), decayed
    assert "student.model.layers.1.mixer.o_proj.weight" in decayed
    assert len(decayed) + len(kept) == len(list(module.parameters()))


def test_untied_lm_head_is_decayed_and_flops_count_attention():
    cfg = load_config(TINY / "pretrain_hypenet.yaml",
                      ["pretrain.model.tie_word_embeddings=false", "pretrain.model.vocab_size=500"])
    model = build_pretrain_model(cfg)
    decay, no_decay = param_groups(model, 0.1)
    assert any(p is model.lm_head.weight for p in decay["params"])
    assert any(p is model.model.embed_tokens.weight for p in no_decay["params"])
    # 6 N (lm_head, not the input embedding) + 12 L_attn d T
    n = unique_numel(model)
    c = model.config
    expect = 6 * (n - 500 * 64) + 12 * 1 * (4 * 16) * 64
    assert train_flops_per_token(c, n, 64) == expect


@pytest.mark.parametrize("name,overrides", GRID, ids=[n for n, _ in GRID])
def test_every_grid_variant_is_a_hypenet(name, overrides):
    """Every sweep variant maps to the intended HypeNet config; a tiny copy of it trains one step on
    CPU."""
    cfg = load_config(SWEEPS / "base_500m.yaml", [*overrides, *TINY_SHAPE, "model.attn_layers=[]"])
    kw = hypenet_kwargs(cfg)
    types, m, arch = kw["mixer_types"], cfg.model, cfg.pretrain.arch
    attn = [i for i, t in enumerate(types) if t == "attention"]
    if arch == "transformer":
        assert attn == list(range(8)) and kw["attn_rope"] and kw["attn_logits_scale_base"] is None
    else:
        assert attn == [0, 4] and set(types) - {"attention"} == {"swa" if arch == "swan"
                                                                 else m.rnn_mixer}
        if arch == "swan":
            assert kw["sliding_window"] == 512 and kw["swa_rope"] and not kw["attn_rope"]
        else:
            assert (kw["attn_rope"], kw["rnn_rope"]) == {
                "hype": (False, True), "all_rope": (True, True), "all_nope": (False, False),
                "attn_rope_rnn_nope": (True, False)}[m.pe]
    # every variant's mixers exist
    assert set(types) <= set(MIXER_CLASSES), sorted(set(types) - set(MIXER_CLASSES))
    model = build_pretrain_model(cfg)
    ids = torch.randint(0, 97, (2, 16))
    out = model(ids, labels=ids)
    out.loss.backward()
    assert (math.isfinite(out.loss.item())
            and model.model.layers[1].mlp.down_proj.weight.grad is not None)


# ---------------------------------------------------------------------------------- errors, --check
@pytest.mark.parametrize("overrides,text", [
    (["pretrain.arch=rnn"], "pretrain.arch: must be one of transformer|swan|hypenet"),
    (["model.pe=rope"], "model.pe: must be one of hype|all_rope|all_nope|attn_rope_rnn_nope"),
    (["model.rnn_mixer=lstm"], "model.rnn_mixer: must be one of lightning|gdn|gla|rwkv7|mamba2"),
    (["model.attn_layers=0,4"], "model.attn_layers: layer 4 outside 0..3"),
    (["pretrain.model.num_key_value_heads=3"],
     "pretrain.model.num_key_value_heads: 3 does not divide num_attention_heads=4"),
    (["pretrain.model.head_dim=15"], "pretrain.model.head_dim: 15 must be even"),
    (["pretrain.arch=transformer", "model.pe=null", "model.attn_layers=0"],
     "model.attn_layers: pretrain.arch=transformer has attention in every layer"),
    (["pretrain.sliding_window=64"], "pretrain.sliding_window: only used by arch=swan"),
    (["model.teacher=Qwen/Qwen3-1.7B"], "model.teacher: stage pretrain trains from scratch"),
    (["pretrain.arch=null", "model.pe=null"],
     "pretrain.arch: must be one of transformer|swan|hypenet, got 'null'"),
    (["pretrain.model=null"], "pretrain.model: expected a mapping of PretrainModelConfig keys"),
    (["pretrain=null"], "pretrain: stage pretrain needs this section"),
    (["model.arch=swan"], "model.arch: unknown key: model.arch moved to pretrain.arch"),
    (["model.scratch.hidden_size=8"],
     "model.scratch: unknown key: model.scratch moved to pretrain.model"),
    (["loss.objective=kl"], "loss.objective: pretrain trains with ce"),
    (["parallel.sp_size=8"], "parallel.sp_size: 8 does not divide num_attention_heads=4"),
    (["pretrain.model.hidden_sise=8"], "did you mean 'pretrain.model.hidden_size'"),
])
def test_bad_configs_give_clear_errors(overrides, text, capsys):
    with pytest.raises(SystemExit) as exc:
        launch_pretrain(argv=["--config", str(TINY / "pretrain_hypenet.yaml"), "--check",
                              *overrides])
    assert exc.value.code == 2
    assert text in capsys.readouterr().err


def test_check_prints_the_plan_and_refuses_what_cannot_run(capsys):
    base = str(SWEEPS / "base_500m.yaml")
    assert launch_pretrain(argv=["--config", base, "--check", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert ("arch: hypenet" in out and "A R R R A R R R" in out
            and "micro 4 x grad_accum 4 x dp 8" in out)
    assert "parameters: 594.8M" in out
    assert launch_pretrain(argv=["--config", base, "--check", "--world-size", "3"]) == 2
    assert "global_batch_size" in capsys.readouterr().err
    assert launch_pretrain(argv=["--config", str(TINY / "stage2.yaml"), "--check"]) == 2
    assert "this is the pretrain launcher" in capsys.readouterr().err
    if "gdn" not in MIXER_CLASSES:
        assert launch_pretrain(argv=["--config", base, "--check", "model.rnn_mixer=gdn"]) == 2
        assert "model.rnn_mixer=gdn: no implementation of mixer 'gdn'" in capsys.readouterr().err


def test_bench_smoke(tmp_path):
    """bench/bench_pretrain.py keeps running (tiny shapes, CPU) and writes its JSON contract."""
    spec = importlib.util.spec_from_file_location("bench_pretrain",
                                                  REPO / "bench" / "bench_pretrain.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "pretrain.json"
    assert bench.main(["--smoke", "--steps", "2", "--peak-tflops", "0.001", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {r["variant"] for r in data["results"]} == {"hypenet-lightning-hype", "transformer"}
    for r in data["results"]:
        assert r["tokens_per_s"] > 0 and r["gflop_per_token"] > 0 and math.isfinite(r["loss_last"])
    assert "device" in data["env"] and "date" in data["env"]
    # one eager run: it is also the best
    assert data["transformer_mfu"] == data["transformer_mfu_eager"] > 0
    assert (bench.parse_run("compiled:8", 4) == ("compiled", 8)
            and bench.parse_run("eager", 4) == ("eager", 4))
    with pytest.raises(SystemExit, match="MODE"):
        bench.parse_run("fast:8", 4)


def test_bench_counts_the_keys_packed_documents_attend():
    """Packed documents attend their own doc_len keys, not the row's seq_len."""
    spec = importlib.util.spec_from_file_location("bench_pretrain",
                                                  REPO / "bench" / "bench_pretrain.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from halo_dist.stages.pretrain import pretrain_config, train_flops_per_token

    a = bench.parse_args(["--smoke"])
    config = pretrain_config(bench.variant_config("transformer", a))
    n = 1_000_000
    assert (bench.flops_per_trained_token(config, n, a)
            == train_flops_per_token(config, n, a.doc_len))
    assert bench.flops_per_trained_token(config, n, a) < train_flops_per_token(config, n, a.seq_len)


def test_the_training_build_compiles_the_layers_and_uses_the_loss_backend_it_is_given():
    """``model.compile`` and ``loss.backend`` reach stage pretrain's module (the sweeps' MFU depends
    on both), and the compiled module's loss equals the eager one's."""
    from halo_dist.stages.pretrain import build_pretrain_module

    base = ["pretrain.model.vocab_size=97", "pretrain.model.hidden_size=32",
            "pretrain.model.intermediate_size=64", "pretrain.model.head_dim=8",
            "model.dtype=float32", "model.activation_checkpointing=false"]
    eager, _ = build_pretrain_module(load_config(TINY / "pretrain_hypenet.yaml", base))
    fast, _ = build_pretrain_module(load_config(TINY / "pretrain_hypenet.yaml",
                                                base + ["model.compile=layer",
                                                        "loss.backend=compiled"]))
    assert eager.backend == "auto" and fast.backend == "compiled"
    assert all(layer._compiled_call_impl is None for layer in eager.student.model.layers)
    assert all(layer._compiled_call_impl is not None for layer in fast.student.model.layers)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1),
             "position_ids": torch.arange(16).expand(2, -1)}
    ref, got = eager(**batch, normalizer=32.0)[0], fast(**batch, normalizer=32.0)[0]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
