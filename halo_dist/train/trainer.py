"""The teacher-student engine: one Trainer runs HALO stages 1, 2 and 3 on DeepSpeed.

Order of construction (fixed, see ``Trainer.setup``): distributed + process groups -> validate the
batch layout -> the run and checkpoint folders are writable -> check the shards and ``final/`` ->
the teacher's identity and the checkpoint to resume (the newest that verifies), refused if it
belongs to another run (nothing is built yet) -> teacher (frozen, replicated) -> stage module
(student + loss) -> sequence parallelism injected into every mixer -> activation checkpointing ->
DeepSpeed engine (ZeRO stage from the config, partitioned over all dp*sp ranks) -> loader ->
checkpoint manager -> resume -> metrics -> signal handlers. A subclass (``opd.trainer.OPDTrainer``)
replaces what is built (``_build``) and what a checkpoint adds (``_extra_state``, ``_rank_state``).

Loss normalisation (token-weighted over micro-batches, SP and DP ranks): each optimizer step first
counts the global number of loss tokens N (one all-reduce), then every micro-batch's loss is its
token sum divided by ``N / (grad_accum * D)``, D being the number of ranks DeepSpeed averages
gradients over (dp, times sp under ZeRO-3; see parallel/deepspeed_setup.py). The resulting gradient
is exactly that of the global token mean.

Non-finite losses (``optim.nonfinite``): ``train/stopping.py`` says how a step is stopped or
skipped.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..config import RunConfig, deepspeed_config, fit_to_world
from ..data import build_loader
from ..models.fla_offsets import install as install_fla_offsets
from ..models.flops import attention_flop_terms, attention_flops_coefficient, flops_per_token
from ..parallel import ProcessGroups, SequenceParallel
from ..parallel.deepspeed_setup import check_resume_zero_stage
from ..parallel.env import local_device
from ..stages.output import check_stage_output
from ..stages.protocol import StageModule, StageSpec
from ..errors import IncompatibleInputError
from .checkpoint import TRAINER_STATE, CheckpointManager, find_resume
from .data_checks import check_training_data
from .disk import refuse_unwritable
from .entry import record_run_start
from .evaluation import HeldoutEval
from .metrics import ATTENDED, MetricsLogger, attended_context, check_wandb
from .profiling import StepProfiler
from .resume_check import check_same_run
from .schedules import LRSchedule, make_lr_scheduler
from .student_check import check_same_student
from .stopping import (NonFiniteLossError, NonFinitePolicy, StopControl, backward_and_step,
                       finish_skipped_step, is_nonfinite)
from ..teacher import run_teacher_digests

StepHook = Callable[[Any, int], None]
"""``hook(trainer, step)``: called after every optimizer step (``step``: the 1-based step just
taken) and its metrics, before that step's evaluation, checkpoint and stop-signal check
(``Trainer.train``)."""

LossHook = Callable[[Any, int, torch.Tensor], torch.Tensor]
"""``hook(trainer, step, loss) -> loss``: every micro-batch's loss passes through it before the
non-finite check and the backward (``step``: the 1-based optimizer step the loss belongs to)."""


def run_loss_hooks(trainer, loss: torch.Tensor) -> torch.Tensor:
    """``loss`` through the trainer's ``loss_hooks`` in order (none in a launched run)."""
    for hook in trainer.loss_hooks:
        loss = hook(trainer, trainer.step + 1, loss)
    return loss


def _at_least_one(count):
    """A token count floored at 1, as a tensor on its device or a number (no host sync)."""
    return count.clamp(min=1) if torch.is_tensor(count) else max(1, count)


class Trainer(StopControl):
    """Builds everything from a validated RunConfig, then ``train()`` runs the loop."""

    flush_denormals_on_cpu = True  # see _start
    # the optimizer has groups of different settings (see _check_saved_state)
    several_param_groups = False

    def __init__(self, cfg: RunConfig, argv: list[str] | None = None, *,
                 stage: StageSpec | None = None):
        """``stage``: the stage's row of ``halo_dist.registry`` (``run_stage`` passes it)."""
        self.cfg, self.argv, self.stage = cfg, argv, stage
        self.step = 0
        self.tokens_seen = 0
        self.nonfinite = NonFinitePolicy.from_config(cfg.optim)
        # extension points for callers that build the trainer themselves (the tests inject faults
        # here); a launched run leaves both empty
        self.step_hooks: list[StepHook] = []
        self.loss_hooks: list[LossHook] = []

    # ------------------------------------------------------------------------------ setup
    def setup(self) -> "Trainer":
        """Build everything, in the order of the module doc. Subclasses change what is built
        (:meth:`_build`), which inputs are checked (:meth:`_check_data`) and what a checkpoint holds
        (:meth:`_extra_state`, :meth:`_rank_state`, :meth:`_check_saved_state`)."""
        self._start()
        refuse_unwritable(self.cfg.logging.run_dir, self.cfg.checkpoint_dir)  # before any read
        self._check_data()
        check_stage_output(self.cfg)  # the output folder the run ends with, before it starts
        self._find_resume()
        self._build()
        self.ckpt = CheckpointManager(self.cfg.checkpoint_dir, self.cfg.checkpoint.keep_last)
        self._maybe_resume()
        self._start_metrics()
        self._install_signal_handlers()
        return self

    def _start(self) -> None:
        """Distributed start and process groups, the config fitted to this world and its batch
        layout, the device, dtype and LR schedule."""
        from ..parallel.deepspeed_setup import start_distributed

        check_wandb(self.cfg.logging.wandb)
        start_distributed()
        self.groups = ProcessGroups.build(sp_size=self.cfg.parallel.sp_size)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.cfg = cfg = fit_to_world(self.cfg, self.world, announce=self.rank == 0)
        self.layout = cfg.validate_against_world(self.world)
        self.device = local_device()
        self.dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        if self.device.type == "cpu" and self.flush_denormals_on_cpu:
            # Distillation gradients get tiny (student ≈ teacher); x86 denormal arithmetic then runs
            # ~10-100x slower (measured: 47 s vs 4 s per demo step). GPUs flush denormals anyway.
            torch.set_flush_denormal(True)
        if self.device.type == "cuda":
            install_fla_offsets()  # fla's packed-batch state passes without a sync per layer
        self.schedule = LRSchedule.from_config(cfg)

    def _check_data(self) -> None:
        """Before anything is built: the held-out split exists, the shards fit the model's
        vocabulary and (``data.verify=full``) are intact."""
        check_training_data(self.cfg, self.rank, self.world)

    def _find_resume(self) -> None:
        """Before anything is built: the teacher's identity by content, and the checkpoint this run
        continues (``resume_path``: the newest that verifies, ``checkpoint.find_resume``; None: a
        new run), refused if it belongs to another run or holds a state this run cannot continue
        (resume_check, :meth:`_check_saved_state`)."""
        cfg = self.cfg
        self.teacher_files = run_teacher_digests(cfg.model, cfg.checkpoint_dir)
        self.resume_path = find_resume(cfg.checkpoint_dir, cfg.checkpoint.resume, self.rank,
                                       self.world, announce=self.rank == 0)
        if self.resume_path is not None:
            check_same_run(self.resume_path, cfg, self.teacher_files, announce=self.rank == 0)
            self._check_saved_state(self.resume_path)

    def _check_saved_state(self, path: Path) -> None:
        """Refuse a checkpoint this run cannot continue: its LR schedule changed in the past
        (``LRSchedule.check_resume``), another ZeRO format (``check_resume_zero_stage``), or ZeRO-3
        on another rank count with several parameter groups (DeepSpeed 0.19.8's re-partitioning
        gives every group the first one's settings and one shared Adam step: silently wrong)."""
        state = json.loads((path / TRAINER_STATE).read_text())
        self.schedule.check_resume(state["schedule"], state["step"])
        saved_world = state.get("world_size", self.world)
        if (saved_world != self.world and self.cfg.parallel.zero_stage == 3
                and self.several_param_groups):
            raise IncompatibleInputError(
                f"{path} was written on {saved_world} rank(s); this run has {self.world}: stage "
                f"{self.cfg.stage.name} under ZeRO-3 resumes only on the same number of ranks "
                "(DeepSpeed's ZeRO-3 re-partitioning mixes up its optimizer's parameter groups; "
                f"ZeRO 0-2 resume on any number). Resume on {saved_world} rank(s)")
        check_resume_zero_stage(path, self.cfg.parallel.zero_stage)

    def _build(self) -> None:
        """The stage's module and teacher, sequence parallelism, the engine, the teacher's placement
        and the loaders."""
        from ..parallel.deepspeed_setup import initialize_engine

        cfg = self.cfg
        self.module, self.teacher = self._build_stage()
        self._apply_sequence_parallel()
        self._init_engine()
        self._place_teacher(initialize_engine)
        self.loader = build_loader(
            cfg.data.train, cfg.data.seq_len, cfg.data.micro_batch_size, self.groups.dp_rank,
            self.layout.dp_size, self.groups.sp_rank, cfg.parallel.sp_size, seed=cfg.data.seed,
            num_workers=cfg.data.num_workers,
            shuffle=cfg.data.shuffle, tokenizer=self._tokenizer_for_check(),
            # full: already checked (check_training_data)
            verify="size" if cfg.data.verify == "full" else "sha256",
        )
        self.heldout = HeldoutEval.from_trainer(self)

    def _init_engine(self) -> None:
        """``self.module`` and the optimizer (:meth:`_optimizer`) in a DeepSpeed engine (ZeRO stage
        from the config, partitioned over all dp*sp ranks), set to load a checkpoint written on
        another number of ranks."""
        from ..parallel.deepspeed_setup import initialize_engine, sp_loss_factor

        self.ds_config = deepspeed_config(self.cfg, self.layout)
        self.ds_config.setdefault("zero_allow_untested_optimizer", True)
        self.reshard = self._needs_reshard()
        # ZeRO partitions came from another number of ranks: re-partition (checkpoint.py)
        if self.reshard:
            self.ds_config["checkpoint"] = {**self.ds_config.get("checkpoint", {}),
                                            "load_universal": True}
        self.loss_ranks = self.layout.dp_size * sp_loss_factor(self.ds_config, self.groups)
        optimizer, scheduler = self._optimizer()
        self.engine, self.optimizer, _, self.scheduler = initialize_engine(
            self.module, self.ds_config, self.groups, optimizer=optimizer, lr_scheduler=scheduler
        )
        if self.cfg.parallel.zero_stage == 3 and hasattr(self.module, "enable_zero3"):
            self.module.enable_zero3()

    def _build_stage(self) -> tuple[StageModule, torch.nn.Module | None]:
        if self.stage is None or self.stage.build is None:
            raise TypeError(f"{type(self).__name__} needs a StageSpec with a build function "
                            "(halo_dist.registry)")
        module, teacher = self.stage.build(self.cfg)
        module.to(self.device, self.dtype)
        if teacher is not None:
            teacher.to(self.device, self.dtype)
        return module, teacher

    def _place_teacher(self, initialize_engine) -> None:
        """``replicated``: a full bf16 copy per GPU (fits up to 8B on 80 GB+). ``zero3``: sharded
        over all ranks by a ZeRO-3 engine without optimizer; its forward gathers each layer just in
        time."""
        if self.teacher is None or self.cfg.parallel.teacher_placement == "replicated":
            return
        from ..parallel.deepspeed_setup import frozen_teacher_zero3_config

        teacher_ds = frozen_teacher_zero3_config(self.layout.micro_batch_size,
                                                 self.layout.grad_accum_steps,
                                                 self.layout.global_batch_size,
                                                 bf16=self.dtype == torch.bfloat16)
        self.teacher_engine = initialize_engine(self.teacher, teacher_ds, self.groups)[0]
        self.teacher_engine.eval()

    def _apply_sequence_parallel(self) -> None:
        if self.cfg.parallel.sp_size == 1:
            return
        from ..parallel.apply import apply_sequence_parallel, apply_sequence_parallel_to_mixers

        sp = SequenceParallel(self.groups.sp_group)
        apply_sequence_parallel_to_mixers(self.module.sp_mixers(), sp)
        if self.teacher is not None:
            apply_sequence_parallel(self.teacher, sp)

    def _optimizer(self):
        o = self.cfg.optim
        params = [p for p in self.module.parameters() if p.requires_grad]
        fused = self.device.type == "cuda"
        opt = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                weight_decay=o.weight_decay, fused=fused or None,
                                foreach=None if fused else True)
        return opt, make_lr_scheduler(opt, self.schedule)

    def _tokenizer_for_check(self):
        """The teacher's tokenizer, so shards made with another one are refused (random teachers
        have none)."""
        if self.cfg.model.teacher == "random":
            return None
        from transformers import AutoTokenizer

        from ..teacher import teacher_path

        try:
            return AutoTokenizer.from_pretrained(teacher_path(self.cfg.model.teacher))
        except (OSError, ValueError):
            return None

    def _start_metrics(self) -> None:
        # ZeRO-3 leaves partitioned parameters empty; ds_numel is the full size
        def numel(p) -> int:
            return int(getattr(p, "ds_numel", p.numel()))

        n_train = sum(numel(p) for p in self.module.parameters() if p.requires_grad)
        n_teacher = (sum(numel(p) for p in self.teacher.parameters()) if self.teacher is not None
                     else 0)
        # stage 1 trains RNN layers only: no trained attention
        student = getattr(self.module, "student", None)
        terms = attention_flop_terms(getattr(student, "config", None),
                                     getattr(self.teacher, "config", None))
        self.metrics = MetricsLogger.from_config(
            self.cfg, rank=self.rank, world_size=self.world, device=self.device,
            flops_per_token=flops_per_token(n_train, n_teacher),
            attn_flops_per_key=attention_flops_coefficient(**terms),
            start_step=self.step, start_tokens=self.tokens_seen,
        )
        record_run_start(self.cfg, self.layout, self.metrics, self.rank, self.argv)

    # ------------------------------------------------------------------------------ resume / save
    def _needs_reshard(self) -> bool:
        """Whether the resumed checkpoint's ZeRO partitions must be re-made for this number of ranks
        (it was written on another; ZeRO 0 keeps whole states and loads anywhere)."""
        path = self.resume_path
        if path is None:
            return False
        saved = json.loads((path / TRAINER_STATE).read_text()).get("world_size", self.world)
        if saved == self.world:
            return False
        if self.rank == 0:
            plural = "s" if saved > 1 else ""
            how = ("re-partitioned through DeepSpeed's universal checkpoint"
                   if self.cfg.parallel.zero_stage else "ZeRO 0 holds whole optimizer states")
            print(f"resume: {path.name} was written on {saved} rank{plural} -> {self.world} now "
                  f"({how})", flush=True)
        return self.cfg.parallel.zero_stage > 0

    def _maybe_resume(self) -> None:
        """Continue ``resume_path``: refused if it holds another student (an OPD rung is not
        compared by config), else the engine (model, optimizer, LR scheduler, this rank's RNG)
        through the checkpoint manager, then the trainer's own state (:meth:`_load_state`)."""
        path = self.resume_path
        if path is None:
            return
        check_same_student(path, self.module.student_config)
        state = self.ckpt.load(self.engine, path, universal=self.reshard)
        self._load_state(state, path)
        if self.rank == 0:
            print(self._resumed_message(path), flush=True)

    def _load_state(self, state: dict, path: Path) -> None:
        """The run's position and non-finite count from ``state`` (trainer_state.json), then what
        :meth:`_extra_state` saved."""
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.nonfinite.load_state_dict(state.get("nonfinite"))
        self._load_extra_state(state, path)

    def _load_extra_state(self, state: dict, path: Path) -> None:
        self.loader.load_state_dict(state["loader"])

    def _resumed_message(self, path: Path) -> str:
        return f"resumed from {path} at step {self.step} ({self.tokens_seen} tokens)"

    def save(self, root: Path | None = None, **replace) -> Path:
        """Checkpoint the state after ``self.step`` steps (collective) into ``root/step-N``: the
        run's checkpoints by default (pruned to ``checkpoint.keep_last``); another root keeps every
        save.
        ``replace``: trainer-state entries to record instead of the live ones (the non-finite stop
        records the loader position before its step)."""
        manager = self.ckpt if root is None else CheckpointManager(root, keep_last=None)
        state = {**self._trainer_state(), **replace}
        cfg_text = ((Path(self.cfg.logging.run_dir) / "config.yaml").read_text() if self.rank == 0
                    else "")
        return manager.save(self.engine, self.step, state, cfg_text, self._rank_state())

    def _trainer_state(self) -> dict:
        """trainer_state.json: the run's position and identity, which every resume reads and checks
        (``_needs_reshard``, resume_check), and the trainer's own entries (:meth:`_extra_state`)."""
        return {"step": self.step, "tokens_seen": self.tokens_seen,
                "schedule": self.schedule.state_dict(), "world_size": self.world,
                "stage": self.cfg.stage.name, "teacher": self.cfg.model.teacher,
                "teacher_files": self.teacher_files,
                "student_config": self.module.student_config.to_dict(),
                "nonfinite": self.nonfinite.state_dict(), **self._extra_state()}

    def _extra_state(self) -> dict:
        """The trainer's entries of trainer_state.json (plain JSON): here the loader position and
        layout."""
        return {"loader": self.loader.state_dict(), "layout": vars(self.layout)}

    def _rank_state(self) -> dict | None:
        """This rank's state beyond its RNGs (tensors and plain values, read back weights-only);
        none here."""
        return None

    # ------------------------------------------------------------------------------ the loop
    def train(self) -> dict:
        """Run to ``total_steps`` (or a stop signal); returns the last logged scalars. The loop of
        every trainer: subclasses change what a step is (:meth:`train_step`) and what surrounds it
        (:meth:`_start_training`, :meth:`_after_step`, :meth:`_end_training`)."""
        total, every = self.cfg.total_steps, self.cfg.checkpoint.every_steps
        last = {}
        self._start_training(total)
        while self.step < total:
            last = self.train_step() or last
            for hook in self.step_hooks:
                hook(self, self.step)
            self._after_step(total)
            if every and self.step % every == 0 and self.step < total:
                self.save()
            self._stop_if_signalled()
        self._end_training()
        return last

    def _start_training(self, total: int) -> None:
        self._data = iter(self.loader)
        self.engine.train()
        log = self.cfg.logging
        self._profiler = StepProfiler(log.profile_at_step, log.profile_steps, log.run_dir,
                                      self.rank, self.device)
        if self.step == 0:
            self._maybe_evaluate(total)

    def train_step(self) -> dict | None:
        """One optimizer step on the next ``grad_accum`` micro-batches; returns the scalars logged
        at it (None on a step that logs nothing)."""
        self._profiler.before_step(self.step + 1)
        self._step_start = self.loader.state_dict()  # the position of this step's first batch
        micro_batches = [next(self._data) for _ in range(self.layout.grad_accum_steps)]
        normalizer = self._global_tokens(micro_batches) / (self.layout.grad_accum_steps
                                                           * self.loss_ranks)
        # A step with a non-finite loss in any micro-batch is dropped (module doc). The flag stays
        # on the device and is read once, before the last backward: a read after every forward
        # would drain the GPU's queue between each forward and its backward.
        bad, skipping, losses = None, False, []
        for i, batch in enumerate(micro_batches):
            self._track_attended_keys(batch)
            loss, tracked, count = self.engine(**self._to_device(batch), normalizer=normalizer)
            loss = run_loss_hooks(self, loss)
            bad = is_nonfinite(loss) if bad is None else bad | is_nonfinite(loss)
            if i == len(micro_batches) - 1:
                skipping = self._nonfinite(bad)
            losses.append((tracked, count))
            backward_and_step(self.engine, loss, drop=skipping)
        if not skipping:
            for tracked, count in losses:
                self.metrics.add("train/loss", tracked / _at_least_one(count), weight=count)
        self.step += 1
        self.tokens_seen += self.layout.tokens_per_step
        self._profiler.after_step(self.step)
        if skipping:
            finish_skipped_step(self.engine, self.scheduler)
        else:
            self.nonfinite.step_ok()
            self.metrics.add("optim/grad_norm", self._grad_norm())
        if self.nonfinite.mode == "skip" and self.metrics.should_log(self.step):
            self.metrics.add("train/skipped_steps", float(self.nonfinite.total))
        return self.metrics.maybe_log(self.step, self.tokens_seen,
                                      self.schedule.lr_at(self.step - 1))

    def _after_step(self, total: int) -> None:
        """After a step's metrics and hooks, before its checkpoint."""
        self._maybe_evaluate(total)

    def _end_training(self) -> None:
        if self.cfg.checkpoint.save_final:
            self.save()

    def _maybe_evaluate(self, total: int) -> None:
        """Held-out ``eval/`` scalars before the first step, every ``eval.every_steps`` and after
        the last.

        Called after a step's metrics and before its checkpoint, so a run resumed from that
        checkpoint does not evaluate the same step twice."""
        every = self.cfg.eval.every_steps
        if self.heldout is None or not (self.step == 0 or self.step % every == 0
                                        or self.step == total):
            return
        start = time.perf_counter()
        # ends in an all-reduce read on the host: the GPU is done
        scalars = self.heldout.run(self.engine)
        self.metrics.log_eval(self.step, scalars, seconds=time.perf_counter() - start)

    def _global_tokens(self, micro_batches) -> float:
        local = sum(self.module.loss_tokens(b) for b in micro_batches)
        # filled on the device: a host-to-device copy would be a second synchronisation
        t = torch.full((1,), float(local), device=self.device, dtype=torch.float64)
        dist.all_reduce(t)
        return max(1.0, float(t.item()))

    def _track_attended_keys(self, batch: dict) -> None:
        """Keys per token of this micro-batch's documents (host-side cu_seqlens: no GPU sync), for
        MFU."""
        ids = batch["input_ids"]
        cu = batch.get("cu_seqlens")
        # without boundaries a row is one causal document; under SP the local slice is 1/sp of it
        keys = attended_context(cu) if cu is not None else float(ids.shape[-1]
                                                                 * batch.get("sp_size", 1))
        self.metrics.add(ATTENDED, keys, weight=float(ids.numel()))

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v
                for k, v in batch.items()}

    def _grad_norm(self) -> float:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def _nonfinite_stop(self) -> NonFiniteLossError:
        """Checkpoint the last good state and return the error that names the step's batch."""
        # the last good state: parameters before this step's update, and the loader before its
        # batches, so a resume (after lowering the LR, say) trains step ``step + 1`` on the same
        # batch
        start = self._step_start
        path = self.save(loader=start)
        rows = self.layout.grad_accum_steps * self.layout.dp_size * self.cfg.data.micro_batch_size
        return NonFiniteLossError(
            f"non-finite loss at step {self.step + 1} ({self.nonfinite.stop_reason()}) "
            f"on the batch of epoch {start['epoch']}, packed rows "
            f"{start['rows_consumed']}..{start['rows_consumed'] + rows - 1} of that "
            f"epoch's order (data.seed={start['seed']}, {start['seq_len']} tokens per row, all "
            "data-parallel ranks); the last good state, positioned before that batch, is saved in "
            f"{path}. Lower optim.lr or inspect that batch before resuming."
        )

    # ------------------------------------------------------------------------------ outputs
    def finish(self) -> Path | None:
        """Write the stage's output under ``<run_dir>/final`` (rank 0) and close the metrics."""
        out = self.stage.write_output(self, Path(self.cfg.logging.run_dir) / "final")
        self.metrics.close()
        return out
