"""The entry point of every stage launcher (:func:`run_stage`: build, train, write the output,
always clean up) and what rank 0 records when a run starts."""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from ..config import RunConfig, format_config, save_resolved
from ..stages.protocol import StageSpec
from .metrics import MetricsLogger, run_hparams
from .profiling import process_age_s


def record_run_start(cfg: RunConfig, layout, metrics: MetricsLogger, rank: int,
                     argv: list[str] | None) -> None:
    """Rank 0: write <run_dir>/config.yaml, hand it and the hyperparameters to the metrics writers
    (TB text + hparams, W&B config), print the config and the batch layout (world = dp x sp, global
    = micro x accum x dp)."""
    if rank != 0:
        return
    path = save_resolved(cfg, Path(cfg.logging.run_dir) / "config.yaml", argv=argv)
    metrics.log_config(path.read_text(), run_hparams(cfg, layout))
    print(format_config(cfg), flush=True)
    print(layout.describe(), flush=True)


def _age_note() -> str:
    """``; process age Ns`` where the platform tells it (the wall time after this line is the
    exit)."""
    age = process_age_s()
    return "" if age is None else f"; process age {age:.1f}s"


def run_stage(cfg: RunConfig, stage: StageSpec, argv: list[str] | None = None,
              **trainer_kwargs) -> Path | None:
    """Entry point of every stage launcher: build, train, write the output, always clean up.
    ``stage``: the stage's row of ``train.registry``; its trainer is built with
    ``(cfg, argv, stage=stage, **trainer_kwargs)``."""
    start = time.time()
    trainer = stage.trainer_cls(cfg, argv, stage=stage, **trainer_kwargs)
    try:
        trainer.setup()
        t0 = time.time()
        # the time to the first step (models, DeepSpeed, data) is what short jobs pay
        if trainer.rank == 0:
            age = process_age_s()
            before = (
                "" if age is None
                else f" (the process started {age - (t0 - start):.1f}s before it: imports, config)")
            print(f"setup: {t0 - start:.1f}s{before}", flush=True)
        trainer.train()
        t1 = time.time()
        out = trainer.finish()
        if trainer.rank == 0:
            print(f"{cfg.stage.name} finished in {time.time() - t0:.1f}s (training {t1 - t0:.1f}s, "
                  f"output {time.time() - t1:.1f}s) -> {out}{_age_note()}", flush=True)
        return out
    finally:
        if dist.is_initialized():
            dist.barrier()
