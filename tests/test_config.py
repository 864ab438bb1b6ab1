"""Typed run config: shipped files, overrides, typo detection, validation, resolved round trip."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from halo_dist.config import (ConfigError, RunConfig, config_from_dict, deepspeed_config,
                              describe, load_config, load_resolved, load_tree, parse_run_args,
                              read_resolved_meta, save_resolved, to_dict, validate_file,
                              with_overrides)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
# A sweep grid (configs/sweeps/grid.yaml: `base` + `variants` of overrides) is not a config itself:
# every variant it lists is validated over its base instead (test_every_sweep_variant_validates).
SWEEP_GRIDS = sorted(p for p in CONFIGS.glob("sweeps/*.yaml")
                     if "variants" in (yaml.safe_load(p.read_text()) or {}))
SHIPPED_YAML = sorted(p for p in CONFIGS.rglob("*.yaml") if p not in SWEEP_GRIDS)
SWEEP_VARIANTS = [(grid, v["name"], v["overrides"]) for grid in SWEEP_GRIDS
                  for v in yaml.safe_load(grid.read_text())["variants"]]
STAGE_FILES = sorted(CONFIGS.glob("stages/*/stage*.yaml"))
TINY_STAGE2 = CONFIGS / "tiny" / "stage2.yaml"


def minimal(**sections) -> dict:
    """A small valid raw config; keyword arguments replace or add whole sections."""
    raw = {
        "stage": {"name": "stage2"},
        "model": {"teacher": "Qwen/Qwen3-1.7B", "num_layers": 28, "attn_layers": [2, 3, 6]},
        "data": {"train": "shards/", "seq_len": 512, "global_batch_size": 96,
                 "micro_batch_size": 12},
        "optim": {"lr": 1e-4},
        "schedule": {"kind": "cosine", "total_steps": 1000},
    }
    raw.update(sections)
    return raw


def problems_of(excinfo) -> dict[str, str]:
    return dict(excinfo.value.problems)


# --- shipped files ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", SHIPPED_YAML, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_shipped_yaml_validates(path):
    cfg = validate_file(path)
    # a run config names its stage; base files (models/, common) do not
    full = "stage" in load_tree(path)
    assert (cfg is not None) == full


@pytest.mark.parametrize("grid,name,overrides", SWEEP_VARIANTS,
                         ids=[f"{g.name}:{n}" for g, n, _ in SWEEP_VARIANTS])
def test_every_sweep_variant_validates(grid, name, overrides, monkeypatch):
    """Each variant of a sweep grid is a valid pretrain config over the grid's base (40K steps x
    128 x 4K tokens, WSD 5e-4 -> 5e-5, 1K warm-up, 8K decay, wd 0.1), and fits 8 to 32 GPUs."""
    monkeypatch.chdir(REPO)  # the grid's base path is relative to the repo root
    base = yaml.safe_load(grid.read_text())["base"]
    cfg = load_config(base, overrides)
    assert cfg.stage.name == "pretrain" and cfg.loss.objective == "ce" and cfg.pretrain.arch in name
    assert (cfg.data.seq_len, cfg.data.global_batch_size, cfg.total_steps) == (4096, 128, 40_000)
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.optim.weight_decay) == (5e-4, 5e-5, 0.1)
    assert ((cfg.schedule.kind, cfg.schedule.warmup_steps, cfg.schedule.decay_steps)
            == ("wsd", 1000, 8000))
    s = cfg.pretrain.model
    assert ((s.num_hidden_layers, s.hidden_size, s.intermediate_size, s.head_dim,
             s.num_attention_heads, s.num_key_value_heads, s.vocab_size, s.rope_theta)
            == (28, 1024, 3072, 128, 16, 8, 50304, 50_000.0))
    for world in (8, 16, 32):
        cfg.validate_against_world(world)


@pytest.mark.parametrize("path", STAGE_FILES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_stage_files_match_paper_and_fit_1_to_8_gpus(path, monkeypatch):
    monkeypatch.chdir(REPO)  # deepspeed_config paths are relative to the repo root
    cfg = load_config(path)
    stage = cfg.stage.name
    seq, batch, tokens = {"stage1": (512, 32, 320e6), "stage2": (512, 96, 1e9),
                          "stage3": (16384, 128, 1e9)}[stage]
    assert ((cfg.data.seq_len, cfg.data.global_batch_size, cfg.schedule.total_tokens)
            == (seq, batch, tokens))
    assert cfg.optim.betas == (0.9, 0.95) and cfg.optim.weight_decay == 0.0
    assert cfg.schedule.warmup_steps == 50 and cfg.optim.grad_clip == 1.0
    for world in (1, 2, 4, 8):
        layout = cfg.validate_against_world(world)
        ds = deepspeed_config(cfg, layout)
        # ZeRO-3 everywhere except 2B stage 2, which compiles its layers (model.compile needs ZeRO
        # <= 2)
        zero = 1 if cfg.model.compile != "none" else 3
        assert ds["train_batch_size"] == batch and ds["zero_optimization"]["stage"] == zero
    assert (cfg.model.compile != "none") == (path.relative_to(CONFIGS).as_posix()
                                             == "stages/2b/stage2.yaml")


def test_paper_defaults_per_size(monkeypatch):
    monkeypatch.chdir(REPO)
    expect = {"2b": (1e-4, 500.0, [2, 3, 6, 8, 9, 21, 25]), "5b": (5e-5, 600.0, None),
              "9b": (3e-5, 900.0, [1, 2, 4, 6, 7, 10, 24, 33, 34])}
    for size, (lr, a, layers) in expect.items():
        cfg = load_config(CONFIGS / f"stages/{size}/stage2.yaml")
        assert cfg.optim.lr == lr and cfg.model.logits_scaling_a == a
        assert layers is None or cfg.model.attn_layers == layers
    assert load_config(CONFIGS / "stages/2b/stage3.yaml").schedule.kind == "constant"
    assert load_config(CONFIGS / "stages/9b/stage1.yaml").total_steps == 19532


# --- unknown keys ----------------------------------------------------------------------------

def test_unknown_keys_name_path_and_suggest():
    raw = minimal()
    raw["optim"]["lrr"] = 1e-3
    raw["optimizer"] = {}
    raw["warmup_steps"] = 3
    with pytest.raises(ConfigError) as excinfo:
        config_from_dict(raw)
    found = problems_of(excinfo)
    assert "did you mean 'optim.lr'" in found["optim.lrr"]
    assert "did you mean 'optim'" in found["optimizer"]
    assert "did you mean 'schedule.warmup_steps'" in found["warmup_steps"]


def test_unknown_override_and_nested_path():
    with pytest.raises(ConfigError,
                       match=r"schedule\.warmup_step: unknown key .*'schedule\.warmup_steps'"):
        config_from_dict(minimal(), ["schedule.warmup_step=10"])
    with pytest.raises(ConfigError, match=r"model\.random_teacher\.hiden_size: unknown key"):
        load_config(TINY_STAGE2, ["model.random_teacher.hiden_size=64"])


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(minimal(loss={"objectiv": "kl"})))
    with pytest.raises(ConfigError,
                       match=r"loss\.objectiv: unknown key \(did you mean 'loss\.objective'\?\)"):
        load_config(path)


def test_unknown_key_in_a_base_file_names_that_file(tmp_path):
    """A typo two files down names the base file that holds it, not only the file given."""
    (tmp_path / "common.yaml").write_text("data: {trian: x}\n")
    (tmp_path / "mid.yaml").write_text("base: common.yaml\n")
    raw = minimal(base="mid.yaml")
    raw["optim"]["lrr"] = 1.0  # a typo in the top file: the user already knows which file that is
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as excinfo:
        load_config(tmp_path / "run.yaml")
    found = problems_of(excinfo)
    assert ("did you mean 'data.train'" in found["data.trian"]
            and str(tmp_path / "common.yaml") in found["data.trian"])
    assert "base file" not in found["optim.lrr"]
    with pytest.raises(ConfigError,
                       match=r"data\.trian: unknown key .*in base file .*common\.yaml"):
        validate_file(tmp_path / "mid.yaml")


def test_override_into_a_value_is_an_error():
    with pytest.raises(ConfigError, match=r"optim\.lr: is a value, not a section"):
        config_from_dict(minimal(), ["optim.lr.x=1"])
    with pytest.raises(ConfigError, match="key.sub=value"):
        config_from_dict(minimal(), ["optim.lr"])


# --- types and coercion ----------------------------------------------------------------------

def test_overrides_are_coerced_by_field_type():
    cfg = config_from_dict(minimal(), [
        "optim.lr=3e-5", "model.attn_layers=2,3,6", "logging.tensorboard=off",
        "model.logits_scaling_a=none", "parallel.zero_stage=2", "schedule.total_steps=none",
        "schedule.total_tokens=320M", "optim.betas=[0.9,0.98]", "optim.grad_clip=null"])
    assert cfg.optim.lr == 3e-5 and cfg.model.attn_layers == [2, 3, 6]
    assert cfg.logging.tensorboard is False and cfg.model.logits_scaling_a is None
    assert cfg.parallel.zero_stage == 2 and cfg.schedule.total_tokens == 320_000_000
    assert cfg.optim.betas == (0.9, 0.98) and cfg.optim.grad_clip is None
    assert config_from_dict(minimal(), ["model.attn_layers=[4, 5]"]).model.attn_layers == [4, 5]
    assert config_from_dict(minimal(), ["model.attn_layers=[]"]).model.attn_layers == []


def test_yaml_11_exponent_strings_become_floats(tmp_path):
    path = tmp_path / "run.yaml"  # YAML 1.1 reads 1e-4 (no dot) as a string
    path.write_text(yaml.safe_dump(minimal()).replace("lr: 0.0001", "lr: 1e-4"))
    assert "lr: 1e-4" in path.read_text()
    assert load_config(path).optim.lr == 1e-4


def test_bad_types_are_all_reported():
    with pytest.raises(ConfigError) as excinfo:
        config_from_dict(minimal(), [
            "data.seq_len=abc", "logging.tensorboard=maybe", "parallel.zero_stage=4",
            "loss.objective=revers_kl", "model.attn_layers=2,x", "optim.betas=0.9",
            "data.seed=1.5"])
    found = problems_of(excinfo)
    assert "expected an integer" in found["data.seq_len"]
    assert "expected a boolean" in found["logging.tensorboard"]
    assert "one of 0|1|2|3" in found["parallel.zero_stage"]
    assert "did you mean 'reverse_kl'" in found["loss.objective"]
    assert "expected an integer" in found["model.attn_layers[1]"]
    assert "expected 2 values" in found["optim.betas"]
    assert "data.seed" in found


def test_a_loss_backend_that_is_not_kept_is_refused():
    """``loss.backend`` takes the backends the loss keeps (liger, measured slower, was removed)."""
    with pytest.raises(ConfigError) as excinfo:
        config_from_dict(minimal(), ["loss.backend=liger"])
    assert "must be one of auto|torch|compiled|triton, got 'liger'" in problems_of(excinfo)[
        "loss.backend"]


def test_missing_required_keys():
    raw = minimal()
    del raw["data"]["seq_len"], raw["optim"]
    with pytest.raises(ConfigError) as excinfo:
        config_from_dict(raw)
    assert set(problems_of(excinfo)) == {"data.seq_len", "optim"}


# --- impossible combinations ---------------------------------------------------------------

@pytest.mark.parametrize("overrides, key, text", [
    (["parallel.sp_size=3"], "data.seq_len", "not divisible by parallel.sp_size=3"),
    (["data.micro_batch_size=7"], "data.global_batch_size", "not a multiple"),
    (["stage.name=stage3", "loss.objective=reverse_kl"],
     "loss.objective", "stage3 trains with kl|ce"),
    (["stage.name=stage1"], "loss.objective", "stage1 trains with mse"),
    (["loss.kl_max_position=0"], "loss.kl_max_position", "must be > 0"),
    (["stage.name=stage3", "loss.objective=ce", "loss.kl_max_position=8192"],
     "loss.kl_max_position", "objective is ce"),
    (["logging.profile_at_step=-1"], "logging.profile_at_step", "must be >= 0"),
    (["logging.profile_steps=0"], "logging.profile_steps", "must be > 0"),
    (["optim.lr=0"], "optim.lr", "must be > 0"), (["optim.lr=-1e-4"], "optim.lr", "must be > 0"),
    (["optim.min_lr=1e-3"], "optim.min_lr", "exceeds lr"),
    (["optim.betas=0.9,1.0"], "optim.betas", "[0, 1)"),
    (["schedule.total_tokens=1B"], "schedule.total_steps", "exactly one"),
    (["schedule.kind=wsd"], "schedule.decay_steps", "required for kind=wsd"),
    (["schedule.decay_steps=10"], "schedule.decay_steps", "only used by kind=wsd"),
    (["schedule.kind=wsd", "schedule.decay_steps=990"], "schedule.decay_steps", "exceeds"),
    (["schedule.warmup_steps=1000"], "schedule.warmup_steps", "not below"),
    (["model.attn_layers=2,2"], "model.attn_layers", "duplicate"),
    (["model.attn_layers=28"], "model.attn_layers", "outside 0..27"),
    (["model.logits_scaling_a=1"], "model.logits_scaling_a", "must be > 1"),
    (["model.teacher=random"], "model.random_teacher", "exactly when"),
    (["loss.objective=kl", "loss.ce_weight=0.5", "stage.name=stage3", "loss.objective=ce"],
     "loss.ce_weight", "only applies to KL"),
    (["loss.temperature=0"], "loss.temperature", "must be > 0"),
    (["checkpoint.keep_last=0"], "checkpoint.keep_last", "must be > 0"),
])
def test_impossible_combinations(overrides, key, text):
    with pytest.raises(ConfigError) as excinfo:
        config_from_dict(minimal(), overrides)
    found = problems_of(excinfo)
    assert key in found and text in found[key], found


@pytest.mark.parametrize("path", ["tiny/stage1.yaml", "tiny/stage2.yaml", "tiny/stage3.yaml",
                                  "opd/tiny.yaml"])
def test_model_pe_is_accepted_by_the_distillation_stages(path):
    assert load_config(CONFIGS / path, ["model.pe=all_rope"]).model.pe == "all_rope"


def test_model_pe_is_still_refused_where_the_encoding_is_fixed():
    with pytest.raises(ConfigError,
                       match="model.pe: only pretrain.arch=hypenet chooses a position encoding"):
        load_config(CONFIGS / "tiny" / "pretrain_transformer.yaml", ["model.pe=all_rope"])


# --- the pretrain section ------------------------------------------------------------------

TINY_PRETRAIN = CONFIGS / "tiny" / "pretrain_hypenet.yaml"


def old_layout(tree: dict) -> dict:
    """``tree`` (a pretrain config) with its pretrain section written into model: (arch,
    sliding_window, scratch)."""
    tree = json.loads(json.dumps(tree))
    section = tree.pop("pretrain")
    tree["model"].update(arch=section["arch"], sliding_window=section.get("sliding_window"),
                         scratch=section["model"])
    return tree


def test_a_config_with_the_pretrain_keys_under_model_says_where_they_moved(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old_layout(load_tree(TINY_PRETRAIN))))
    with pytest.raises(ConfigError) as excinfo:
        load_config(path)
    found = problems_of(excinfo)
    assert found["model.arch"] == "unknown key: model.arch moved to pretrain.arch"
    assert (found["model.sliding_window"] == "unknown key: model.sliding_window moved to "
                                             "pretrain.sliding_window")
    assert found["model.scratch"] == "unknown key: model.scratch moved to pretrain.model"
    assert set(found) == {"model.arch", "model.sliding_window", "model.scratch"}, found
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({"model": {"scratch": {"hidden_size": 8}}}))
    with pytest.raises(ConfigError, match=r"model\.scratch: unknown key: model\.scratch moved to "
                                          r"pretrain\.model"):
        validate_file(tmp_path / "base.yaml")  # a partial (base) file
    with pytest.raises(ConfigError,
                       match=r"model\.arch: unknown key: model\.arch moved to pretrain\.arch"):
        load_config(TINY_PRETRAIN, ["model.arch=swan"])  # an override that names the model: key


def test_the_pretrain_section_is_required_by_stage_pretrain_and_refused_elsewhere():
    tree = load_tree(TINY_PRETRAIN)
    del tree["pretrain"]
    with pytest.raises(ConfigError) as excinfo:
        config_from_dict(tree)
    assert problems_of(excinfo) == {"pretrain": "stage pretrain needs this section: pretrain.arch "
                                                "(transformer | swan | hypenet) and pretrain.model "
                                                "(the shape: vocab_size, num_hidden_layers, ...)"}
    pretrain = load_tree(TINY_PRETRAIN)["pretrain"]
    for path in ("tiny/stage1.yaml", "tiny/stage2.yaml", "tiny/stage3.yaml", "opd/tiny.yaml"):
        tree = load_tree(CONFIGS / path)
        with pytest.raises(ConfigError) as excinfo:
            config_from_dict({**tree, "pretrain": pretrain})
        stage = tree["stage"]["name"]
        assert problems_of(excinfo) == {"pretrain": "only used by stage pretrain (from scratch), "
                                                    f"not {stage}: remove the section"}, path


def test_the_pretrain_section_is_checked_against_the_model_section():
    cfg = load_config(TINY_PRETRAIN)
    p = cfg.pretrain
    assert (p.arch, p.sliding_window, p.model.num_hidden_layers) == ("hypenet", None, 4)
    for overrides, key, text in [
        (["model.attn_layers=4"], "model.attn_layers",
         "layer 4 outside 0..3 (pretrain.model.num_hidden_layers=4)"),
        (["pretrain.arch=swan", "model.pe=all_nope"], "model.pe",
         "only pretrain.arch=hypenet chooses"), (["pretrain.sliding_window=0", "pretrain.arch=swan",
                                                  "model.pe=null"], "pretrain.sliding_window",
                                                 "must be > 0"),
        (["pretrain.model.num_attention_heads=3"],
         "pretrain.model.num_key_value_heads", "does not divide"),
        (["parallel.sp_size=8"], "parallel.sp_size", "does not divide num_attention_heads=4"),
    ]:
        with pytest.raises(ConfigError) as excinfo:
            load_config(TINY_PRETRAIN, overrides)
        found = problems_of(excinfo)
        assert key in found and text in found[key], (overrides, found)
    swan = load_config(TINY_PRETRAIN,
                       ["pretrain.arch=swan", "pretrain.sliding_window=16", "model.pe=null"])
    assert swan.pretrain.sliding_window == 16


def test_sp_must_divide_random_teacher_heads():
    with pytest.raises(ConfigError,
                       match=r"parallel\.sp_size: 8 does not divide num_attention_heads=4"):
        load_config(TINY_STAGE2, ["parallel.sp_size=8"])


def test_validate_against_world():
    cfg = config_from_dict(minimal())
    layout = cfg.validate_against_world(4)
    assert (layout.dp_size, layout.grad_accum_steps, layout.tokens_per_step) == (4, 2, 96 * 512)
    sp = with_overrides(cfg, ["parallel.sp_size=2"]).validate_against_world(8)
    assert (sp.dp_size, sp.sp_size, sp.grad_accum_steps) == (4, 2, 2)
    with pytest.raises(ConfigError, match=r"96 must equal micro_batch_size \(12\) x grad_accum x "
                                          r"dp \(5\).*global_batch_size 60 or 120"):
        cfg.validate_against_world(5)
    with pytest.raises(ConfigError, match=r"parallel\.sp_size: 2 does not divide the world size 3"):
        with_overrides(cfg, ["parallel.sp_size=2"]).validate_against_world(3)


def test_fit_micro_batch_keeps_the_global_batch():
    from halo_dist.config import describe, fit_to_world

    cfg = config_from_dict(minimal())  # global 96, micro 12
    assert fit_to_world(cfg, 16) is cfg  # off by default: the layout error stays
    with pytest.raises(ConfigError, match=r"96 must equal micro_batch_size \(12\)"):
        cfg.validate_against_world(16)
    fit = with_overrides(cfg, ["data.fit_micro_batch=true"])
    assert fit_to_world(fit, 8) is fit  # 12 x 8 = 96 already fits
    for world, micro, accum in ((16, 6, 1), (32, 3, 1), (64, 1, 0)):
        if accum == 0:  # 96 is not a multiple of 64 ranks: nothing fits, the hint explains
            with pytest.raises(ConfigError, match=r"global_batch_size 64 or 128"):
                fit_to_world(fit, world).validate_against_world(world)
            continue
        fitted = fit_to_world(fit, world)
        layout = fitted.validate_against_world(world)
        assert ((layout.micro_batch_size, layout.grad_accum_steps, layout.global_batch_size)
                == (micro, accum, 96))
        assert fitted.data.micro_batch_size == micro and fitted.optim == fit.optim
    assert "micro batch 12 -> 6 on 16 ranks (global batch 96 unchanged)" in describe(fit, 16)
    assert "x sp 2; global batch 96 = micro 12 x grad_accum 1 x dp 8" in describe(
        with_overrides(fit, ["parallel.sp_size=2"]), 16)  # dp counts data-parallel ranks only


def test_fit_to_world_announces_the_change(capsys):
    from halo_dist.config import fit_to_world

    fit = with_overrides(config_from_dict(minimal()), ["data.fit_micro_batch=true"])
    fit_to_world(fit, 16, announce=True)
    assert "micro batch 12 -> 6" in capsys.readouterr().out
    fit_to_world(fit, 8, announce=True)
    assert capsys.readouterr().out == ""


# --- inheritance, round trip, CLI, DeepSpeed -------------------------------------------------

def test_base_inheritance_merges_and_detects_cycles(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.yaml").write_text(
        "model: {teacher: t, attn_layers: [1, 2], logits_scaling_a: 500}\n")
    raw = minimal()
    raw.pop("model")
    raw["base"] = "models/m.yaml"
    raw["model"] = {"attn_layers": [5], "logits_scaling_a": None}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_config(tmp_path / "run.yaml")
    assert cfg.model.teacher == "t" and cfg.model.attn_layers == [5]  # lists replace, not merge
    assert cfg.model.logits_scaling_a is None  # null in the child wins
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="include each other"):
        load_tree(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: nope.yaml\n")
    with pytest.raises(ConfigError, match="base file not found: nope.yaml"):
        load_tree(tmp_path / "c.yaml")


def test_partial_files_report_typos(tmp_path):
    (tmp_path / "m.yaml").write_text("model: {teacher: t, atn_layers: [1]}\noptim: {betas: 5}\n")
    with pytest.raises(ConfigError) as excinfo:
        validate_file(tmp_path / "m.yaml")
    found = problems_of(excinfo)
    assert "model.attn_layers" in found["model.atn_layers"] and "optim.betas" in found


def test_resolved_round_trip(tmp_path):
    cfg = load_config(TINY_STAGE2, ["optim.lr=2e-3", "model.attn_layers=0,3"])
    path = save_resolved(cfg, tmp_path / "run" / "config.yaml", argv=["stage2.py", "optim.lr=2e-3"])
    assert load_resolved(path) == cfg
    assert load_config(path) == cfg  # a resolved file is a valid --config
    meta = read_resolved_meta(path)
    assert meta["command"] == "stage2.py optim.lr=2e-3" and "commit" in meta["git"]
    assert to_dict(load_resolved(path)) == to_dict(cfg)


def test_configs_are_frozen_and_with_overrides_revalidates():
    cfg = config_from_dict(minimal())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optim.lr = 1.0
    assert with_overrides(cfg, {"optim.lr": 5e-5}).optim.lr == 5e-5
    with pytest.raises(ConfigError):
        with_overrides(cfg, {"optim.lr": -1.0})


def test_dry_run_prints_resolved_config(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as excinfo:
        parse_run_args(["--config", str(TINY_STAGE2), "optim.lr=2e-3", "--dry-run",
                        "--world-size", "2"])
    assert excinfo.value.code == 0
    out = capsys.readouterr().out
    assert "lr: 0.002" in out and "world 2 = dp 2 x sp 1" in out
    assert yaml.safe_load(out)["stage"]["name"] == "stage2"
    cfg, args = parse_run_args(["--config", str(TINY_STAGE2), "--local_rank=0"])
    assert cfg.stage.name == "stage2" and args.local_rank == 0
    with pytest.raises(SystemExit) as excinfo:
        parse_run_args(["--config", str(TINY_STAGE2), "optim.lrr=1"])
    assert excinfo.value.code == 2 and "did you mean 'optim.lr'" in capsys.readouterr().err


def test_describe_shows_derived_values():
    text = describe(load_config(CONFIGS / "stages/2b/stage2.yaml"), world_size=8)
    assert "total steps:     20,346" in text and "micro 12 x grad_accum 1 x dp 8" in text


def test_deepspeed_json_conflicts_and_comments(tmp_path):
    cfg = config_from_dict(minimal())
    layout = cfg.validate_against_world(2)
    ds = deepspeed_config(cfg, layout,
                          {"_comment": "x", "zero_optimization": {"overlap_comm": True}})
    assert ds["gradient_accumulation_steps"] == 4 and ds["zero_optimization"] == {
        "stage": 3, "overlap_comm": True}
    with pytest.raises(ConfigError) as excinfo:
        deepspeed_config(cfg, layout, {"zero_optimization": {"stage": 2}, "optimizer": {},
                                       "train_batch_size": 64})
    assert set(problems_of(excinfo)) == {"deepspeed.zero_optimization.stage", "deepspeed.optimizer",
                                         "deepspeed.train_batch_size"}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_clipping": 1.0, "_note": 1}))
    ds = deepspeed_config(with_overrides(cfg, [f"parallel.deepspeed_config={path}"]), layout)
    assert "_note" not in ds and ds["gradient_clipping"] == 1.0


def test_direct_construction_is_validated():
    from halo_dist.config import OptimConfig
    assert OptimConfig(lr=1).lr == 1.0 and isinstance(OptimConfig(lr=1).lr, float)
    with pytest.raises(ConfigError, match="lr: must be > 0"):
        OptimConfig(lr=0.0)
    assert isinstance(config_from_dict(minimal()), RunConfig)


def test_teacher_depth_check_is_offline(tmp_path):
    from halo_dist.teacher import offline_teacher_depth, teacher_depth_problem

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 28}))
    assert offline_teacher_depth(str(tmp_path)) == 28
    assert teacher_depth_problem(str(tmp_path), 28) is None
    assert ("has 28 layers but the stage configs are sized for a 36-layer "
            "teacher" in teacher_depth_problem(str(tmp_path), 36))
    # would need the network: no verdict
    assert offline_teacher_depth("nobody-here/not-a-cached-model") is None
    assert teacher_depth_problem("nobody-here/not-a-cached-model", 36) is None
    assert offline_teacher_depth("not a repo id!") is None


def test_tiny_configs_read_what_the_readme_data_prep_writes():
    """configs/tiny/*'s default data.train is the --out of the README's offline data prep command
    with the small tokenizer (the manifest folder tokenize writes), and their models embed exactly
    its vocabulary, so the README's CPU commands run without a data.train override."""
    import re

    from halo_dist.assets.tokenizer import OFFLINE_SMALL_NAME, SMALL_VOCAB_SIZE

    readme = (REPO / "README.md").read_text()
    commands = re.findall(
        r"python -m data_prep\.tokenize --wiki-offline --tokenizer (\S+) .*--out (\S+)", readme)
    tokenizer_of = {out: tokenizer for tokenizer, out in commands}
    for name in ("stage1", "stage2", "stage3", "pretrain_hypenet", "pretrain_transformer"):
        tree = load_tree(CONFIGS / "tiny" / f"{name}.yaml")
        assert tokenizer_of.get(tree["data"]["train"]) == OFFLINE_SMALL_NAME, name
        shape = tree["pretrain"]["model"] if "pretrain" in tree else tree["model"]["random_teacher"]
        assert shape["vocab_size"] == SMALL_VOCAB_SIZE, name
