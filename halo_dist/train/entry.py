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
from .stopping import StopRequested


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
    """Entry point of every stage launcher: check the model sources, start the process group, lock
    the run folders (rank 0, before anything is written), then build, train and write the output.
    An error on any rank ends every rank with that rank's message (``parallel.rank_failures``);
    the ranks meet at a last barrier only when every rank succeeded.
    ``stage``: the stage's row of ``halo_dist.registry``; its trainer is built with
    ``(cfg, argv, stage=stage, **trainer_kwargs)``."""
    from ..models.trust import check_model_sources
    from ..parallel.deepspeed_setup import start_distributed
    from ..parallel.env import local_device
    from ..parallel.rank_failures import FailureWatch
    from .run_lock import claim_run_dirs

    start = time.time()
    check_model_sources(cfg)  # before anything is built or written
    start_distributed()
    local_device()  # this rank's GPU is the current one before the first NCCL collective
    locks = None
    watch = FailureWatch(dist.get_rank(), dist.get_world_size(),
                         on_abort=lambda: locks is not None and locks.release()).start()
    try:
        locks = claim_run_dirs(cfg, dist.get_rank())
        out = _build_train_finish(cfg, stage, argv, start, trainer_kwargs)
        dist.barrier()  # the watchdog still runs: a rank failing in finish() ends this one
        return out
    except StopRequested:
        raise  # every rank stops at the same step, after its checkpoint: not a failure
    except BaseException as e:
        reported = watch.report(e)
        if reported is e:
            raise
        raise reported from e
    finally:
        watch.stop()
        if locks is not None:
            locks.release()


def _build_train_finish(cfg: RunConfig, stage: StageSpec, argv: list[str] | None, start: float,
                        trainer_kwargs: dict) -> Path | None:
    trainer = stage.trainer_cls(cfg, argv, stage=stage, **trainer_kwargs)
    trainer.setup()
    t0 = time.time()
    # the time to the first step (models, DeepSpeed, data) is what short jobs pay
    if trainer.rank == 0:
        age = process_age_s()
        before = ("" if age is None else f" (the process started {age - (t0 - start):.1f}s "
                                         "before it: imports, config)")
        print(f"setup: {t0 - start:.1f}s{before}", flush=True)
    trainer.train()
    t1 = time.time()
    out = trainer.finish()
    if trainer.rank == 0:
        print(f"{cfg.stage.name} finished in {time.time() - t0:.1f}s (training {t1 - t0:.1f}s, "
              f"output {time.time() - t1:.1f}s) -> {out}{_age_note()}", flush=True)
    return out
