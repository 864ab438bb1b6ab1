"""Every file DeepSpeed writes for the layouts we train with (bf16, ZeRO 0-3) loads through the
weights_only reader, and the engine resumes from it: the allow-list covers what DeepSpeed stores."""

import pytest

from distributed import run_distributed


def _round_trip(root):
    import os

    import torch
    from torch import nn

    from halo_dist.parallel import ProcessGroups
    from halo_dist.parallel.deepspeed_setup import initialize_engine
    from halo_dist.parallel.safe_load import safe_load

    groups = ProcessGroups.build(sp_size=1)
    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
               "bf16": {"enabled": True},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
               "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
               "steps_per_print": 10**9}
        engine, *_ = initialize_engine(model, cfg, groups)
        loss = engine(torch.randn(2, 16, dtype=torch.bfloat16)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        folder = os.path.join(root, str(stage))
        engine.save_checkpoint(folder, tag="t")
        files = sorted(os.listdir(os.path.join(folder, "t")))
        for f in files:
            # raises on a type not allowed
            safe_load(os.path.join(folder, "t", f), map_location="cpu")
        loaded, _ = engine.load_checkpoint(folder, tag="t")
        out[stage] = (files, loaded is not None)
    return out


@pytest.mark.slow
def test_bf16_zero_checkpoints_load_weights_only_and_resume(tmp_path):
    out = run_distributed(_round_trip, world_size=1, args=(str(tmp_path),), timeout=240)[0]
    for stage, (files, loaded) in out.items():
        assert loaded and any("model_states" in f for f in files), (stage, files)
    # the optimizer file with DeepSpeed's own types
    assert any("optim_states" in f for f in out[1][0])


class _Payload:
    """Unpickling it would create a marker file: the proof that a load ran foreign code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_forced_weights_only_refuses_code_even_where_the_caller_asks_for_full_unpickling(tmp_path):
    """DeepSpeed's universal-checkpoint code calls torch.load(weights_only=False); inside
    forced_weights_only that still reads weights only, and a nested safe_load (our checkpoint
    engine, in the same block) does not drop the DeepSpeed types from the allow-list on its way
    out."""
    import pytest
    import torch
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from halo_dist.parallel.safe_load import UnsafeCheckpointError, forced_weights_only, safe_load

    marker = tmp_path / "ran"
    torch.save({"x": _Payload(str(marker))}, tmp_path / "bad.pt")
    torch.save({"stage": ZeroStageEnum(1), "t": torch.ones(2)}, tmp_path / "good.pt")
    with pytest.raises(UnsafeCheckpointError, match="refusing to load the folder"):
        with forced_weights_only("the folder"):
            torch.load(tmp_path / "bad.pt", weights_only=False)
    assert not marker.exists()
    with forced_weights_only("the folder"):
        safe_load(tmp_path / "good.pt")
        assert torch.load(tmp_path / "good.pt", weights_only=False)["stage"] == ZeroStageEnum(1)
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in __import__("os").environ
