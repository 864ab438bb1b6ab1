"""Metrics: tag namespaces, progress line, MFU arithmetic, interval reduction, JSONL/TB/PNG."""
from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from halo_dist.models.flops import flops_per_token
from halo_dist.train.metrics import (MetricsLogger, check_tag, device_peak_flops, peak_flops_for,
                                     read_metrics)
from halo_dist.train.plots import plot_loss_curves
from halo_dist.train.progress_line import format_duration, format_progress, format_si


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_line_format():
    line = format_progress(120, 20000, loss=2.31412, lr=9.8e-5, tokens_per_s=16_200, mfu=0.314,
                           mem_gib=(41.2, 80.0), eta_s=5 * 3600 + 12 * 60)
    assert line == ("step 120/20000 (0.6%) | loss 2.3141 | lr 9.8e-05 | 16.2K tok/s | MFU 31.4% "
                    "| mem 41.2/80.0 GiB | ETA 5h12m")
    cpu = format_progress(1, 10, loss=None, lr=None, tokens_per_s=None, mfu=None, mem_gib=None,
                          eta_s=None)
    assert cpu == "step 1/10 (10.0%) | loss n/a | lr n/a | tok/s n/a | MFU n/a | mem n/a | ETA n/a"


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (42, "42s"), (725, "12m05s"),
                                           (18720, "5h12m"), (97200, "1d03h")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_format_si():
    assert (format_si(950), format_si(16_200), format_si(1.25e6), format_si(3e9)) == (
        "950", "16.2K", "1.25M", "3G")


@pytest.mark.parametrize("tag", ["train/loss", "optim/lr", "optim/grad_norm", "perf/tokens_per_s",
                                 "perf/mfu", "mem/peak_allocated_gib", "progress/tokens",
                                 "eval/kl"])
def test_known_tags_pass(tag):
    assert check_tag(tag) == tag


@pytest.mark.parametrize("tag", ["loss", "training/loss", "train/", "/loss", "lr"])
def test_tags_outside_namespaces_are_rejected(tag, tmp_path):
    with pytest.raises(ValueError, match="outside the namespaces"):
        check_tag(tag)
    logger = MetricsLogger(tmp_path, total_steps=10, tensorboard=False, jsonl=False,
                           emit=lambda _: None)
    with pytest.raises(ValueError):
        logger.add(tag, 1.0)


def test_flops_per_token_and_peaks():
    # Stage 2, 2B: 6 N_student + 2 N_teacher + 12 L_attn d T for the trained attention layers.
    got = flops_per_token(2.0e9, 1.7e9, attn_layers=7, attn_dim=2048, context=512)
    assert got == 6 * 2.0e9 + 2 * 1.7e9 + 12 * 7 * 2048 * 512
    assert flops_per_token(10, frozen_attn_layers=2, attn_dim=4, context=8) == 60 + 4 * 2 * 4 * 8
    assert peak_flops_for("NVIDIA H200") == 779e12
    assert peak_flops_for("NVIDIA GH200 480GB") == 989e12
    assert peak_flops_for("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for("Some CPU") is None and peak_flops_for(None) is None
    assert device_peak_flops(torch.device("cpu")) is None
    assert device_peak_flops(torch.device("cpu"), override=1e12) == 1e12


def make_logger(tmp_path, clock, lines, **kw):
    return MetricsLogger(tmp_path / "run", total_steps=100, log_every=10, clock=clock,
                         emit=lines.append, device=torch.device("cpu"), **kw)


def test_interval_reduction_jsonl_tensorboard_and_line(tmp_path):
    clock, lines = FakeClock(), []
    with make_logger(tmp_path, clock, lines) as logger:
        for step in range(1, 21):
            # Token-weighted loss: sum(loss * tokens) / sum(tokens) over the interval.
            logger.add("train/loss", torch.tensor(float(step)),
                       weight=torch.tensor(2.0 if step % 2 else 1.0))
            logger.add("optim/grad_norm", torch.tensor(0.5))
            clock.now += 2.0
            out = logger.maybe_log(step, tokens_seen=step * 1000, lr=1e-4)
            assert (out is None) == (step % 10 != 0)
    assert len(lines) == 2 and lines[0].startswith("step 10/100 (10.0%) | loss 5.3333 | lr 1.0e-04")
    assert "| 500 tok/s | MFU n/a | mem n/a | ETA 3m00s" in lines[0]  # CPU: MFU and memory n/a
    assert "ETA 2m40s" in lines[1]  # from the second interval's 2 s/step
    records = [json.loads(line)
               for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert records[1]["step"] == 20 and records[1]["optim/grad_norm"] == 0.5
    expected = sum(s * (2.0 if s % 2 else 1.0) for s in range(11, 21)) / 15.0
    assert records[1]["train/loss"] == pytest.approx(expected)
    assert records[1]["perf/tokens_per_s"] == 500.0 and records[1]["progress/tokens"] == 20000
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "run/tb"))


def test_mfu_from_flops_and_peak_override(tmp_path):
    clock, lines = FakeClock(), []
    logger = make_logger(tmp_path, clock, lines, tensorboard=False, world_size=1,
                         flops_per_token=1e9, peak_flops=1e13)
    logger.add("train/loss", 1.0)
    clock.now = 10.0
    out = logger.log(10, tokens_seen=20_000, lr=1e-4)  # 2000 tok/s x 1e9 / 1e13 = 20 %
    assert out["perf/mfu"] == pytest.approx(0.2) and "MFU 20.0%" in lines[0]
    logger.close()


def test_non_zero_rank_writes_nothing(tmp_path):
    lines = []
    logger = make_logger(tmp_path, FakeClock(), lines, rank=1)
    logger.add("train/loss", 1.0)
    assert logger.log(10, 100)["train/loss"] == 1.0
    assert lines == [] and not (tmp_path / "run").exists()


def test_eval_scalars_and_resumed_records(tmp_path):
    clock, lines = FakeClock(), []
    logger = make_logger(tmp_path, clock, lines, tensorboard=False)
    for step in (10, 20, 10):  # the third record is a resumed run re-logging step 10
        logger.add("train/loss", float(step) + (0.5 if len(lines) == 2 else 0.0))
        clock.now += 1.0
        logger.log(step, step * 10)
    logger.log_eval(20, {"eval/loss": 3.0})
    with pytest.raises(ValueError):
        logger.log_eval(20, {"train/loss": 3.0})
    logger.close()
    series = read_metrics(tmp_path / "run")
    assert series["train/loss"] == [(10, 10.5), (20, 20.0)] and series["eval/loss"] == [(20, 3.0)]
    png = plot_loss_curves({"run": tmp_path / "run"}, tmp_path / "plots/loss.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no train/loss"):
        plot_loss_curves({"run": tmp_path / "empty"}, tmp_path / "x.png")


def _two_rank_worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        logger = MetricsLogger(out_dir, total_steps=4, log_every=2, rank=rank, world_size=2,
                               tensorboard=False, device=torch.device("cpu"), emit=lambda _: None)
        # Rank 0 saw 3 tokens with loss 1, rank 1 saw 1 token with loss 5: token mean = 2.
        logger.add("train/loss", torch.tensor(1.0 if rank == 0 else 5.0),
                   weight=torch.tensor(3.0 if rank == 0 else 1.0))
        out = logger.log(2, tokens_seen=8)
        assert out["train/loss"] == pytest.approx(2.0), out
        logger.close()
    finally:
        dist.destroy_process_group()


def test_two_rank_reduction_is_token_weighted(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # fork: the children reuse the imported torch instead of re-importing it (seconds on CI); spawn
    # when an in-process test before this one left this process's default group up, which forked
    # children would inherit
    mp.start_processes(_two_rank_worker, args=(port, str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn" if dist.is_initialized() else "fork")
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["train/loss"] == pytest.approx(2.0)


def test_attended_keys_of_packed_documents_set_the_attention_flops(tmp_path):
    """MFU counts the keys each token attends under the document mask, not the row length: a row of
    documents 2 + 6 tokens attends (4 + 36) / 8 = 5 keys per token."""
    from halo_dist.train.metrics import ATTENDED, attended_context

    assert attended_context(torch.tensor([0, 2, 8], dtype=torch.int32)) == 5.0
    assert attended_context(torch.tensor([0, 8, 16])) == 8.0  # one document per row: the row length
    clock, lines = FakeClock(), []
    logger = make_logger(tmp_path, clock, lines, tensorboard=False, world_size=1,
                         flops_per_token=1e9, peak_flops=1e13, attn_flops_per_key=1e8)
    logger.add(ATTENDED, 5.0, weight=8)
    logger.add(ATTENDED, 8.0, weight=24)  # token-weighted: (40 + 192) / 32 = 7.25 keys
    clock.now = 10.0
    out = logger.log(10, tokens_seen=20_000)
    assert out[ATTENDED] == pytest.approx(7.25)
    assert out["perf/mfu"] == pytest.approx(2000 * (1e9 + 7.25e8) / 1e13)
    logger.close()


def test_a_resumed_run_keeps_one_history_in_jsonl_and_tensorboard(tmp_path):
    """Steps logged after the checkpoint by the run that stopped are redone by the resumed one: they
    appear once (the resumed values), in metrics.jsonl and in TensorBoard; a torn last line is
    dropped too."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from halo_dist.train.metrics import read_metrics

    def run(start, stop, value, **kw):
        clock = FakeClock()
        with make_logger(tmp_path, clock, [], start_step=start, **kw) as logger:
            if start == 0:
                # evaluated before the first step: kept by a resume
                logger.log_eval(0, {"eval/kl": value})
            for step in range(start + 1, stop + 1):
                logger.add("train/loss", torch.tensor(value))
                clock.now += 1.0
                logger.maybe_log(step, tokens_seen=step * 10)

    run(0, 50, 1.0)  # logs 10..50; its last checkpoint was at step 30
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"step": 60, "train/lo')  # killed mid-write
    run(30, 60, 2.0)  # resumed at 30: redoes 40 and 50
    steps = [json.loads(line)["step"]
             for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 10, 20, 30, 40, 50, 60]
    assert read_metrics(tmp_path / "run")["eval/kl"] == [(0, 1.0)]
    assert read_metrics(tmp_path / "run")["train/loss"] == [(10, 1.0), (20, 1.0), (30, 1.0),
                                                            (40, 2.0), (50, 2.0), (60, 2.0)]
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == \
        [(10, 1.0), (20, 1.0), (30, 1.0), (40, 2.0), (50, 2.0), (60, 2.0)]
    run(0, 20, 3.0)  # a fresh run in the same folder starts a new history
    assert read_metrics(tmp_path / "run")["train/loss"] == [(10, 3.0), (20, 3.0)]
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(10, 3.0), (20, 3.0)]


def tb_events(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    return acc


def test_config_text_and_hparams_go_to_tensorboard_once(tmp_path):
    """The resolved config (text) and the flattened hyperparameters (hparams plugin) are written by
    the run that starts at step 0; a resumed run writes neither again, so TB shows one copy."""
    from halo_dist.train.metrics import CONFIG_TAG, flatten_hparams

    hp = flatten_hparams({"stage": {"name": "stage2"}, "optim": {"lr": 3e-4, "betas": [0.9, 0.95]},
                          "model": {"teacher": None, "attn_layers": [2, 5]},
                          "parallel": {"zero_stage": 3}})
    assert hp == {"stage.name": "stage2", "optim.lr": 3e-4, "optim.betas": "0.9,0.95",
                  "model.teacher": "null", "model.attn_layers": "2,5", "parallel.zero_stage": 3}
    for start in (0, 30):  # the first start, then a resume
        with make_logger(tmp_path, FakeClock(), [], start_step=start) as logger:
            logger.log_config("stage:\n  name: stage2\n", hp)
    acc = tb_events(tmp_path / "run")
    texts = acc.Tensors(CONFIG_TAG + "/text_summary")  # add_text's suffix
    assert [e.step for e in texts] == [0]
    assert texts[0].tensor_proto.string_val[0].decode() == "    stage:\n      name: stage2\n"
    plugin = acc.PluginTagToContent("hparams")
    assert set(plugin) == {"_hparams_/experiment", "_hparams_/session_start_info",
                           "_hparams_/session_end_info"}
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    start = HParamsPluginData.FromString(plugin["_hparams_/session_start_info"]).session_start_info
    assert (start.hparams["optim.lr"].number_value == 3e-4
            and start.hparams["stage.name"].string_value == "stage2")


class FakeWandb:
    """Stands in for the wandb module (not installed here): records init, config and log calls."""

    def __init__(self):
        self.inits, self.logged, self.config_updates, self.finished = [], [], [], 0
        self.config = self

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def update(self, values, allow_val_change=False):
        self.config_updates.append(dict(values))

    def log(self, scalars, step):
        self.logged.append((step, dict(scalars)))

    def finish(self):
        self.finished += 1


def test_wandb_mirrors_the_tensorboard_scalars(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(__import__("sys").modules, "wandb", fake)
    clock = FakeClock()
    with make_logger(tmp_path, clock, [], wandb="halo") as logger:
        logger.log_config("stage: {}\n", {"optim.lr": 1e-3})
        for step in range(1, 21):
            logger.add("train/loss", torch.tensor(float(step)))
            clock.now += 1.0
            logger.maybe_log(step, tokens_seen=step * 100, lr=1e-3)
        logger.log_eval(20, {"eval/kl": 0.5})
    acc = tb_events(tmp_path / "run")
    tb = {(e.step, tag): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    mirrored = {(step, tag): value for step, scalars in fake.logged
                for tag, value in scalars.items()}
    assert mirrored.keys() == tb.keys() and all(mirrored[k] == pytest.approx(tb[k]) for k in tb)
    assert [step for step, _ in fake.logged] == [10, 20, 20]
    assert fake.config_updates == [{"optim.lr": 1e-3}] and fake.finished == 1
    run_id = (tmp_path / "run" / "wandb_id").read_text().strip()
    assert fake.inits[0]["project"] == "halo" and fake.inits[0]["id"] == run_id
    # a resume continues that W&B run
    with make_logger(tmp_path, FakeClock(), [], wandb="halo", start_step=20):
        pass
    # other ranks open no W&B run
    with make_logger(tmp_path, FakeClock(), [], wandb="halo", rank=1):
        pass
    assert [i["id"] for i in fake.inits] == [run_id, run_id]


def test_wandb_set_but_not_installed_is_a_config_error(monkeypatch):
    from halo_dist.config import ConfigError
    from halo_dist.train.metrics import check_wandb

    # import wandb -> ImportError, as when absent
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)
    check_wandb(None)
    with pytest.raises(ConfigError,
                       match=r"logging.wandb: .*pip install wandb, or set logging.wandb null"):
        check_wandb("halo")
    from halo_dist.config.schema import LoggingConfig

    with pytest.raises(ConfigError, match="wandb: must be a W&B project name"):
        LoggingConfig(wandb=" ")


def test_evaluation_time_is_left_out_of_training_throughput(tmp_path):
    """An interval that held an evaluation reports the training steps' own rate; the evaluation's
    wall time is logged beside its scalars (line and perf/eval_seconds)."""
    clock, lines = FakeClock(), []
    logger = make_logger(tmp_path, clock, lines, tensorboard=False)
    logger.log(10, 1000)  # first interval: warm-up
    clock.now += 2.0  # ten steps of training ...
    logger.log_eval(15, {"eval/kl": 0.5}, seconds=3.0)
    clock.now += 3.0  # ... and the evaluation's 3 s
    out = logger.log(20, 2000)
    logger.close()
    assert out["perf/tokens_per_s"] == pytest.approx(1000 / 2.0)
    assert lines[-2].endswith("| kl 0.5000 | 3.0s")
    assert read_metrics(tmp_path / "run")["perf/eval_seconds"] == [(15, 3.0)]


def test_a_failed_metrics_write_is_kept_for_the_trainer_and_not_raised(tmp_path):
    """A full disk under metrics.jsonl: rank 0's log goes on (a rank raising alone would leave the
    others in the next collective), the error names the file and the cause, the writer is closed
    and closing the logger warns instead of raising (the trainer stops the run with a checkpoint:
    tests/test_checkpoint_faults.py)."""
    import errno
    import os

    class FullDisk:
        def write(self, *args):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        flush = close = write

    lines = []
    logger = MetricsLogger(tmp_path, total_steps=4, log_every=1, tensorboard=False,
                           emit=lines.append, device=torch.device("cpu"))
    logger._jsonl.close()
    logger._jsonl = FullDisk()
    for step in (1, 2):
        logger.add("train/loss", 1.0)
        logger.log(step, tokens_seen=10 * step)
    assert logger.write_error.startswith(f"writing {tmp_path / 'metrics.jsonl'} failed: No space "
                                         "left on device ("), logger.write_error
    assert "free on /" in logger.write_error and logger._jsonl is None
    assert lines[-1].startswith("step 2/4")  # the progress line still comes
    logger.close()
    assert lines[-1] == f"warning: {logger.write_error}"
