"""Non-finite loss policy: ``optim.nonfinite: stop | skip`` with
``optim.max_skipped_steps``, for the distillation engine (launcher subprocesses, DeepSpeed ZeRO-3
and ZeRO 0) and OPD at ZeRO 0 (in process). The ``fault_injection.nan_at`` loss hook (steps 3, or 2
and 3) makes those steps' losses NaN on every rank. OPD's skip under ZeRO-3 is in test_opd.py."""

import math

import pytest
import torch
from conftest import tiny_qwen3
from fault_injection import nan_at
from opd_configs import VOCAB, tiny_cfg
from stage_runs import TINY, run_launcher

from halo_dist.config import ConfigError, load_config
from halo_dist.eval.tokenizers import byte_tokenizer
from halo_dist.train.metrics import read_metrics


def test_policy_names_are_checked_by_the_config(tmp_path):
    with pytest.raises(ConfigError, match="optim.nonfinite"):
        load_config(TINY / "stage2.yaml", ["optim.nonfinite=ignore"])
    with pytest.raises(ConfigError, match="optim.max_skipped_steps"):
        load_config(TINY / "stage2.yaml", ["optim.max_skipped_steps=-1"])
    cfg = load_config(TINY / "stage2.yaml", ["optim.nonfinite=skip", "optim.max_skipped_steps=2"])
    assert cfg.optim.nonfinite == "skip" and cfg.optim.max_skipped_steps == 2
    # the default keeps the old behaviour
    assert load_config(TINY / "stage2.yaml", []).optim.nonfinite == "stop"


# ------------------------------------------------------------------------------------------- engine
@pytest.fixture
def launcher_env(monkeypatch):
    """In-process OPD runs (here or in test_opd) leave this process's rendezvous variables set; a
    launcher subprocess must pick its own."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


def _weights(ckpt, zero_stage):
    """fp32 student weights of a Trainer checkpoint folder."""
    if zero_stage == 0:
        module = torch.load(ckpt / "mp_rank_00_model_states.pt", weights_only=False)["module"]
        return {k: v.float() for k, v in module.items()}
    from halo_dist.train.export_checkpoint import consolidated_state

    return consolidated_state(ckpt)


# 3: DeepSpeed's overflow path; 0 (fp32): a plain torch AdamW
@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [3, 0])
def test_engine_skip_drops_the_step_and_finishes(shards, tmp_path, zero_stage, launcher_env):
    run_dir = tmp_path / "skip"
    res = run_launcher("stage2", run_dir, f"data.train={shards}", "model.stage1_weights=null",
                       "schedule.total_steps=5", "checkpoint.every_steps=1",
                       "checkpoint.keep_last=10", f"parallel.zero_stage={zero_stage}",
                       "optim.nonfinite=skip", "optim.max_skipped_steps=1", faults=dict(nan_at=3))
    assert "step 3: non-finite loss, step skipped" in res.stdout
    ckpts = run_dir / "checkpoints"
    w2, w3, w4 = (_weights(ckpts / f"step-0000000{s}", zero_stage) for s in (2, 3, 4))
    # step 3: no update
    assert w2.keys() == w3.keys() and all(torch.equal(w2[k], w3[k]) for k in w2)
    assert any(not torch.equal(w3[k], w4[k]) for k in w3)  # step 4 trained again
    m = read_metrics(run_dir)
    assert [s for s, _ in m["train/loss"]] == [1, 2, 4, 5]  # the skipped step logs no loss
    assert m["train/skipped_steps"][-1] == (5, 1.0)
    lrs = dict(m["optim/lr"])
    assert lrs[3] > lrs[4] > lrs[5]  # the schedule advanced through the skipped step (cosine decay)


@pytest.mark.slow
def test_engine_too_many_skips_stop_with_the_last_good_checkpoint(shards, tmp_path, launcher_env):
    run_dir = tmp_path / "stop"
    res = run_launcher("stage2", run_dir, f"data.train={shards}", "model.stage1_weights=null",
                       "schedule.total_steps=5", "checkpoint.every_steps=0", "optim.nonfinite=skip",
                       "optim.max_skipped_steps=1", faults=dict(nan_at=(2, 3)), expect=2)
    assert ("non-finite loss at step 3 (2 non-finite steps in a row exceed "
            "optim.max_skipped_steps=1" in res.stderr)
    assert "step 2: non-finite loss, step skipped" in res.stdout
    assert (run_dir / "checkpoints" / "step-00000002" / "COMPLETE").exists()


# ------------------------------------------------------------------------------------- OPD (ZeRO 0)
def _opd(run_dir, *overrides, nan_steps=()):
    from halo_dist.opd.trainer import OPDTrainer

    cfg = tiny_cfg(run_dir, "schedule.total_steps=5", "schedule.decay_steps=2", "opd.eval_every=0",
                   "opd.snapshot_every=0", "checkpoint.every_steps=0", *overrides,
                   set0=dict(heldout=0))
    t = OPDTrainer(cfg, hf_teacher=tiny_qwen3(vocab=VOCAB), tokenizer=byte_tokenizer()).setup()
    t.loss_hooks.append(nan_at(*nan_steps))
    weights, step = [], t.train_step

    def recorded():
        out = step()
        weights.append({k: v.detach().clone() for k, v in t.module.student.state_dict().items()})
        return out

    t.train_step = recorded
    return t, weights


def test_opd_skip_drops_the_step(tmp_path):
    t, weights = _opd(tmp_path, "optim.nonfinite=skip", nan_steps=(3,))
    t.train()
    t.finish()
    assert t.step == 5 and t.nonfinite.total == 1
    w2, w3, w4 = weights[1:4]
    assert all(torch.equal(w2[k], w3[k]) for k in w2) and any(not torch.equal(w3[k], w4[k])
                                                              for k in w3)
    assert t.scheduler.last_epoch == 5  # the LR schedule advanced through the skipped step
    m = read_metrics(tmp_path)
    assert ([s for s, _ in m["train/reverse_kl"]] == [1, 2, 4, 5]
            and m["train/skipped_steps"][-1] == (5, 1.0))
    assert all(math.isfinite(v) for _, v in m["train/reverse_kl"])


def test_opd_too_many_skips_stop_with_a_checkpoint(tmp_path):
    from halo_dist.train.stopping import NonFiniteLossError

    t, weights = _opd(tmp_path, "optim.nonfinite=skip", "optim.max_skipped_steps=1",
                      nan_steps=(2, 3))
    with pytest.raises(NonFiniteLossError,
                       match="2 non-finite steps in a row exceed optim.max_skipped_steps=1"):
        t.train()
    ckpt = tmp_path / "checkpoints" / "step-00000002"
    assert (ckpt / "COMPLETE").exists()
    from halo_dist.parallel.safe_load import safe_load

    saved = safe_load(ckpt / "mp_rank_00_model_states.pt")["module"]  # the engine's OPDModule
    # step 2 skipped: step 1's
    assert all(torch.equal(saved[f"student.{k}"], v) for k, v in weights[0].items())
    t.metrics.close()
