"""The DeepSpeed config of a frozen teacher sharded by ZeRO-3
(``parallel.teacher_placement=zero3``); tests/test_engine.py runs that placement."""

import pytest

from halo_dist.parallel.deepspeed_setup import frozen_teacher_zero3_config, zero_stage


@pytest.mark.parametrize("micro,accum,dp,bf16", [(8, 1, 2, True), (2, 3, 4, False)])
def test_frozen_teacher_zero3_config_is_stage3_without_optimizer(micro, accum, dp, bf16):
    ds = frozen_teacher_zero3_config(micro, accum, micro * accum * dp, bf16=bf16)
    assert zero_stage(ds) == 3
    # every parameter sharded
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert "optimizer" not in ds and "scheduler" not in ds
    assert (ds["train_batch_size"]
            == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * dp)
    assert ds["bf16"] == {"enabled": bf16}


def test_zero3_teacher_engine_config():
    """The config ``Trainer._place_teacher`` gives DeepSpeed for a ZeRO-3-sharded frozen teacher:
    the student's batch layout (DeepSpeed checks it), no optimizer, every parameter partitioned
    (threshold 0)."""
    assert frozen_teacher_zero3_config(2, 3, 12, bf16=True) == {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 3,
        "train_batch_size": 12,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    assert frozen_teacher_zero3_config(1, 1, 1, bf16=False)["bf16"] == {"enabled": False}

