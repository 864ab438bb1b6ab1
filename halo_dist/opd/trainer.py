"""The on-policy distillation trainer (OPAL); the stage's pieces are in ``halo_dist.opd.stage``.

``OPDTrainer`` is a ``trainer.Trainer``: the setup (distributed start, layout, teacher identity,
resume checks, the engine, checkpoint manager, metrics), the loop (step hooks, checkpoint cadence,
stop signals), the non-finite policy and checkpoint save/resume (onto another number of ranks at
ZeRO 0-2) are the Trainer's; this module supplies what is built (models, rollout machinery), the
step (rollouts before the update), the held-out evaluation, what a checkpoint holds beyond the
shared state and the export.

Per optimizer step on every rank: sample ``global_batch / dp`` prompts from the curriculum ->
student rollouts at the current horizon -> pack into ``grad_accum`` micro-batches -> all-reduce the
generated-token count N -> per micro-batch: teacher scores, fused reverse KL / normaliser, the
DeepSpeed engine's backward -> at the last micro-batch the engine averages gradients over ranks,
clips and steps AdamW on the run's schedule -> all-reduce the step's KL sum -> the plateau detector
may double the horizon.

``docs/design.md`` ("On-policy distillation") explains the rest: TRL GKD's ``opd.beta``/``lmbda``,
why the student trains under DeepSpeed at every ZeRO stage (sampling from a rollout replica under
ZeRO-3), what a checkpoint holds, signals, the non-finite policy and pre-decay snapshots.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..config.schema import RunConfig
from ..errors import IncompatibleInputError, MissingInputError
from ..models.hypenet.modeling_hypenet import compile_decoder_layers
from ..train.checkpoint import MARKER, TRAINER_STATE, load_rank_state, verify_or_refuse
from ..train.schedules import LRSchedule
from ..train.stopping import (NonFiniteLossError, backward_and_step, finish_skipped_step,
                              is_nonfinite)
from ..train.trainer import Trainer, run_loss_hooks
from .build import build_models
from .prompts import Curriculum
from .rollouts import continuous_rollouts
from .stage import (HorizonSchedule, OPDModule, Rollout, bucket_tag, on_policy_step, pack_rollouts,
                    parameter_groups, position_buckets, rollout_decoder_options, sample_rollouts)


# ------------------------------------------------------------------------------------------------
# The trainer
# ------------------------------------------------------------------------------------------------


class OPDTrainer(Trainer):
    """Builds everything from a validated RunConfig (stage ``opd``); the Trainer's ``setup`` and
    ``train`` run it. What differs from the distillation Trainer: what it builds (:meth:`_build`:
    models, the rollout machinery), a step (rollouts, then the update, :meth:`train_step`), the
    held-out evaluation, the checkpoint's extra contents and the final export."""

    # its CPU runs (the tests' tiny ones) keep x86 denormal arithmetic, which their tolerances were
    # set with
    flush_denormals_on_cpu = False
    several_param_groups = True  # rnn / attn / other, each with its own peak LR

    def __init__(self, cfg: RunConfig, argv=None, *, stage=None, hf_teacher=None, student=None,
                 tokenizer=None, prompt_sets=None):
        if cfg.opd is None:
            raise ValueError("the OPD trainer needs an opd: section (stage.name: opd)")
        super().__init__(cfg, argv, stage=stage)
        self._inject = dict(hf_teacher=hf_teacher, student=student, tokenizer=tokenizer)
        self._prebuilt = prompt_sets
        self.tokens_seen = 0  # generated (trained) tokens, all ranks
        self.eval_history: list[tuple[int, float]] = []
        self.rung = False  # the run continues a snapshot of another run (opd.resume_from)
        self.engine = None  # the DeepSpeed engine around the OPDModule (setup)
        self.rollout_student = None  # ZeRO-3: the gathered copy that generates (module doc)
        self._replica_step = None  # optimizer step the rollout replica was last refreshed at

    # ------------------------------------------------------------------------ setup (Trainer.setup)
    def _check_data(self) -> None:
        """No shards to check: the prompt sets are checked as the curriculum builds them."""

    def _find_resume(self) -> None:
        """The run's own latest checkpoint (checked like the stages'), else ``opd.resume_from``: a
        pre-decay snapshot continued as the next rung, a new run that is not compared with the
        old; named by the user, it verifies or is refused (no fallback)."""
        super()._find_resume()
        if self.resume_path is None and self.cfg.opd.resume_from:
            self.rung, self.resume_path = True, Path(self.cfg.opd.resume_from)
            verify_or_refuse(self.resume_path, self.rank, self.world)
            self._check_saved_state(self.resume_path)

    def _build(self) -> None:
        """The models, the engine around the OPDModule (under ZeRO-3 the rollout replica is copied
        first) and the rollout machinery: horizon schedule, prompt curriculum, this rank's sampling
        generator."""
        self._build_models()
        # copied before the engine partitions the student's weights
        if self.cfg.parallel.zero_stage == 3:
            self.rollout_student = copy.deepcopy(self.module.student).requires_grad_(False).eval()
            self.rollout_module = OPDModule(self.rollout_student, self.teacher,
                                            self.module.temperature, self.module.chunk_size,
                                            self.module.buckets, self.module.beta)
        self._init_engine()
        self.engine.train()
        opd = self.cfg.opd
        self.horizon = HorizonSchedule.from_config(opd)
        self.curriculum = Curriculum(opd, self.tokenizer, self.module.student.config.vocab_size,
                                     rank=self.rank, prebuilt=self._prebuilt, eos_token_id=self.eos)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(opd.seed * 1000 + self.rank)
        self.snap_root = Path(self.cfg.logging.run_dir) / "snapshots"

    def _build_models(self) -> None:
        """Student and teacher (built, or the injected ones), the tokenizer's special ids and the
        ``OPDModule`` (student + loss) that the engine trains."""
        cfg, opd = self.cfg, self.cfg.opd
        student, teacher, self.tokenizer = build_models(cfg, **self._inject)
        self.rollout_decoder_options = rollout_decoder_options(opd, student.config)
        if cfg.model.activation_checkpointing:
            student.model.gradient_checkpointing = True
        # training forwards only: rollouts run the layers eagerly (``sample_rollouts``)
        compile_decoder_layers(student, cfg.model.compile)
        compile_decoder_layers(teacher, cfg.model.compile)
        self.eos = (opd.eos_token_id if opd.eos_token_id is not None
                    else getattr(self.tokenizer, "eos_token_id", None))
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad = pad if pad is not None else (self.eos if self.eos is not None else 0)
        self.buckets = position_buckets(opd.kl_bucket_min, opd.horizon_max)
        self.module = OPDModule(
            student.to(self.device, self.dtype), teacher.to(self.device, self.dtype),
            temperature=cfg.loss.temperature, chunk_size=cfg.loss.chunk_size, buckets=self.buckets,
            beta=opd.beta)
        self.teacher = self.module.teacher
        self.objective = cfg.loss.objective  # names the divergence in metric tags
        self.divergence = {1.0: "reverse KL", 0.0: "forward KL"}.get(
            opd.beta, f"generalized JSD (beta {opd.beta})")
        self.nonfinite_what = self.divergence
        self.module.train()

    def _optimizer(self):
        """AdamW over the student's parameter groups (rnn / attn / other, each with its peak LR);
        every group's LR is its peak times the schedule's multiplier (shape shared, peaks per
        group)."""
        o, opd = self.cfg.optim, self.cfg.opd
        groups = parameter_groups(self.module.student, lr=o.lr, rnn_lr=opd.rnn_lr,
                                  attn_lr=opd.attn_lr, other_lr=opd.other_lr,
                                  train_attention=opd.train_attention)
        opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                weight_decay=o.weight_decay, fused=self.device.type == "cuda")
        self.torch_optimizer = opt  # its param_groups carry the group names and peak LRs
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, self.schedule.multiplier)

    def _generation_model(self):
        """The student that samples rollouts: the refreshed replica under ZeRO-3, else the student
        itself."""
        if self.rollout_student is None:
            return self.module.student
        if self._replica_step != self.step:
            self._refresh_replica()
        return self.rollout_student

    def _scoring_module(self) -> OPDModule:
        """The module evaluation scores with: no collectives, since ranks hold different prompt
        counts."""
        if self.rollout_student is None:
            return self.module
        self._generation_model()
        return self.rollout_module

    @torch.no_grad()
    def _refresh_replica(self) -> None:
        """Copy the ZeRO-3-sharded student into the rollout replica, one decoder layer's weights
        gathered at a time (collective: every rank calls it at the same step)."""
        import deepspeed

        chunks: dict[str, list] = {}
        for name, p in self.module.student.named_parameters():
            parts = name.split(".")
            key = ".".join(parts[:3]) if parts[:2] == ["model", "layers"] else "rest"
            chunks.setdefault(key, []).append((name, p))
        dst = dict(self.rollout_student.named_parameters())
        for named in chunks.values():
            with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
                for name, p in named:
                    dst[name].copy_(p)
        self._replica_step = self.step

    # -------------------------------------------------------------------------- checkpoint contents
    def _check_saved_state(self, path: Path) -> None:
        """Before anything is built: ``path`` is a complete DeepSpeed OPD checkpoint whose schedule
        this run continues, written on this number of ranks unless ZeRO 0-2 can re-partition it; a
        rung starts only from a snapshot taken before its schedule's decay."""
        if not (path / MARKER).exists():
            raise MissingInputError(f"{path} is not a complete OPD checkpoint/snapshot (no "
                                    f"{MARKER} marker)")
        state = json.loads((path / TRAINER_STATE).read_text())
        if state.get("stage") != "opd":
            raise IncompatibleInputError(f"{path} is a {state.get('stage')} checkpoint, not an OPD "
                                         "one")
        saved = LRSchedule.from_state_dict(state["schedule"])
        if self.rung and not saved.is_pre_decay(state["step"]):
            raise IncompatibleInputError(f"{path} was taken at step {state['step']}, after its "
                                         f"schedule's decay started (step {saved.decay_start}): "
                                         "only pre-decay snapshots can start a rung")
        super()._check_saved_state(path)
        if state.get("backend", "torch") != "deepspeed":
            raise IncompatibleInputError(f"{path} holds a plain-torch OPD checkpoint (one "
                                         "state.pt); OPD trains under DeepSpeed and reads "
                                         "DeepSpeed checkpoints only: start the run again")

    def _extra_state(self) -> dict:
        """The horizon and its plateau detector, the held-out curve, and the backend that wrote
        it."""
        return {"horizon": self.horizon.state_dict(), "eval_history": self.eval_history,
                "backend": "deepspeed"}

    def _rank_state(self) -> dict:
        """This rank's rollout sampling: the generator and the curriculum's prompt RNG."""
        return {"generator": self.generator.get_state(), "curriculum": self.curriculum.state_dict()}

    def _load_extra_state(self, state: dict, path: Path) -> None:
        """What :meth:`_extra_state` and :meth:`_rank_state` saved; the rollout replica is stale."""
        if self.rung:  # a new run: its non-finite count starts at 0
            self.nonfinite.load_state_dict(None)
        self.horizon.load_state_dict(state["horizon"])
        self.eval_history = [tuple(e) for e in state.get("eval_history", [])]
        self._replica_step = None
        local = load_rank_state(path, self.rank)
        # None: a rank the checkpoint did not have (written on fewer ranks) keeps its seeded streams
        if local is not None:
            self.generator.set_state(local["generator"])
            self.curriculum.load_state_dict(local["curriculum"])

    def _resumed_message(self, path: Path) -> str:
        return (f"{'rung from' if self.rung else 'resumed from'} {path} at step {self.step} "
                f"(horizon {self.horizon.horizon}, {self.tokens_seen} on-policy tokens)")

    def _maybe_snapshot(self) -> None:
        s, opd = self.step, self.cfg.opd
        if not self.schedule.is_pre_decay(s):
            return
        at_decay = self.schedule.kind == "wsd" and s == self.schedule.decay_start
        if at_decay or (opd.snapshot_every and s % opd.snapshot_every == 0):
            self.save(self.snap_root)

    # ------------------------------------------------------------------------------ one step
    @property
    def _compile_rollouts(self) -> bool:
        """``opd.compile_rollouts`` on CUDA; on CPU (tests, the demo) compiling the step would cost
        more than it saves."""
        return self.cfg.opd.compile_rollouts and self.device.type == "cuda"

    def _rollouts(self, n: int, horizon: int) -> tuple[list[Rollout], float]:
        opd = self.cfg.opd
        picks = self.curriculum.sample(n, self.step, horizon)
        bs = opd.rollout_batch_size or self.cfg.data.micro_batch_size
        t0 = time.perf_counter()
        out = []
        model = self._generation_model()
        if opd.continuous_batching:
            gens = continuous_rollouts(
                model, [p for _, p in picks], horizon, bs, temperature=opd.temperature,
                top_p=opd.top_p, eos_token_id=self.eos, pad_token_id=self.pad,
                stop_at_eos=opd.stop_at_eos, generator=self.generator,
                compile_static=self._compile_rollouts,
                decoder_options=self.rollout_decoder_options)
            out = [Rollout(p, g, name) for (name, p), g in zip(picks, gens)]
            _sync(self.device)
            return out, time.perf_counter() - t0
        for i in range(0, n, bs):
            chunk = picks[i:i + bs]
            gens = sample_rollouts(
                model, [p for _, p in chunk], horizon, temperature=opd.temperature, top_p=opd.top_p,
                eos_token_id=self.eos, pad_token_id=self.pad, stop_at_eos=opd.stop_at_eos,
                generator=self.generator, static_cache=opd.static_decode,
                compile_static=self._compile_rollouts,
                decoder_options=self.rollout_decoder_options)
            out += [Rollout(p, g, name) for (name, p), g in zip(chunk, gens)]
        _sync(self.device)
        return out, time.perf_counter() - t0

    def _fixed_data(self, n: int, horizon: int) -> list[Rollout]:
        """A fixed-data step's documents: prompts with their fixed continuations in place of
        rollouts."""
        return [Rollout(p, c, name)
                for name, p, c in self.curriculum.sample_fixed(n, self.step, horizon)]

    def train_step(self) -> dict:
        """One optimizer step; returns the step's global divergence (reverse KL by default) and
        counts."""
        horizon, opd = self.horizon.horizon, self.cfg.opd
        on_policy = on_policy_step(opd.seed, self.step, opd.lmbda)
        micro, gen_time = self._micro_batches(horizon, on_policy)
        local = sum(p.num_generated for p in micro)
        counts = torch.tensor([float(local)], device=self.device, dtype=torch.float64)
        dist.all_reduce(counts)
        n_global = max(1.0, float(counts.item()))
        t0 = time.perf_counter()
        kl_sum, bucket_sums, train_tokens, skipping = self._accumulate(micro, n_global, horizon)
        grad_norm = self._finish_skipped_step() if skipping else self._reduce_and_step()
        _sync(self.device)
        train_time = time.perf_counter() - t0
        red = torch.stack([kl_sum] + [b[0] for b in bucket_sums]
                          + [torch.as_tensor(b[1], dtype=torch.float64, device=self.device)
                             for b in bucket_sums])
        dist.all_reduce(red)
        red, nb = red.tolist(), len(self.buckets)
        # NaN: the detector ignores it
        kl_mean = red[0] / n_global if not skipping else float("nan")
        self.step += 1
        self.tokens_seen += int(n_global)
        if not skipping:
            self.nonfinite.step_ok()
        out = {"kl": kl_mean, "tokens": n_global, "horizon": horizon, "grad_norm": grad_norm,
               "skipped": skipping, "on_policy": on_policy,
               "gen_tokens_per_s": local / max(gen_time, 1e-9),
               "train_tokens_per_s": train_tokens / max(train_time, 1e-9),
               "buckets": {self.buckets[i]: (red[1 + i], red[1 + nb + i]) for i in range(nb)}}
        self._log_step(out, local, gen_time, train_tokens, train_time)
        # NaN: not fed (module doc)
        fed = kl_mean if on_policy or opd.lmbda == 0.0 else float("nan")
        if self.horizon.update(self.step, fed) and self.rank == 0:
            print(f"step {self.step}: {self.divergence} plateaued at horizon {horizon} -> horizon "
                  f"{self.horizon.horizon}", flush=True)
        return out

    def _micro_batches(self, horizon: int, on_policy: bool) -> tuple[list, float]:
        """This rank's packed micro-batches of the step (rollouts, or the prompt sets' fixed
        continuations), and the seconds spent generating."""
        layout = self.layout
        per_rank, m = layout.micro_batch_size * layout.grad_accum_steps, layout.micro_batch_size
        if on_policy:
            rollouts, gen_time = self._rollouts(per_rank, horizon)
        else:
            rollouts, gen_time = self._fixed_data(per_rank, horizon), 0.0
        # horizon >= 1, so every rollout has a sampled token and every micro-batch is non-empty (the
        # DeepSpeed backend relies on it: each rank must run grad_accum collective forwards)
        return ([pack_rollouts(rollouts[i:i + m]).to(self.device) for i in range(0, per_rank, m)],
                gen_time)

    def _accumulate(self, micro: list, n_global: float, horizon: int):
        """Forward and backward of every micro-batch: ``(kl_sum, [[bucket sum, count]], tokens,
        skipping)``; after a non-finite loss (``optim.nonfinite=skip``) the rest of the step runs
        without accumulating."""
        layout = self.layout
        # every rank's loss is (its KL sum) / normalizer; the engine divides by grad_accum and
        # averages over the dp ranks, so the gradient is that of (the step's KL sum over all ranks)
        # / n_global
        normalizer = n_global / (layout.grad_accum_steps * layout.dp_size)
        kl_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        bucket_sums = [[torch.zeros((), device=self.device, dtype=torch.float64), 0]
                       for _ in self.buckets]
        train_tokens, skipping = 0, False
        for batch in micro:
            loss, kl, count, per_bucket = self.engine(
                batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen,
                batch.loss_mask, batch.gen_index, normalizer=normalizer, horizon=horizon)
            loss = run_loss_hooks(self, loss)
            skipping = skipping or self._nonfinite(is_nonfinite(loss))
            backward_and_step(self.engine, loss, drop=skipping)
            if skipping:
                continue
            kl_sum += kl.double()
            train_tokens += batch.input_ids.shape[1]
            for i, (s, c) in enumerate(per_bucket):
                bucket_sums[i][0] += s.double()
                bucket_sums[i][1] += c
        return kl_sum, bucket_sums, train_tokens, skipping

    def _reduce_and_step(self) -> float:
        """The step's gradient norm: the engine already reduced, clipped and stepped at the last
        micro-batch's boundary."""
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def _finish_skipped_step(self) -> float:
        """No update; the LR schedule advances (a skipped step is a step, see stopping.py's module
        doc)."""
        finish_skipped_step(self.engine, self.scheduler)
        return float("nan")

    def _log_step(self, out: dict, gen_tokens: int, gen_time: float, train_tokens: int,
                  train_time: float) -> None:
        add = self.metrics.add
        if not out["skipped"]:
            add("train/loss", out["kl"], weight=out["tokens"])
            add(f"train/{self.objective}", out["kl"], weight=out["tokens"])
            for (lo, hi), (s, c) in out["buckets"].items():
                if lo < out["horizon"]:
                    add(bucket_tag(lo, hi), s / max(c, 1.0), weight=c)
            add("optim/grad_norm", out["grad_norm"])
        if self.nonfinite.mode == "skip" and self.metrics.should_log(self.step):
            add("train/skipped_steps", float(self.nonfinite.total))
        add("progress/horizon", float(out["horizon"]))
        add("progress/on_policy", float(out["on_policy"]))
        add("progress/gen_tokens_per_rollout", out["tokens"] / self.layout.global_batch_size)
        for g in self.torch_optimizer.param_groups:
            add(f"optim/lr_{g['name']}", self.schedule.multiplier(self.step - 1) * g["initial_lr"])
        if out["on_policy"]:  # a fixed-data step decodes nothing
            add("perf/rollout_tokens_per_s_per_gpu", out["gen_tokens_per_s"])
            add("perf/rollout_time_s", gen_time)
        add("perf/train_tokens_per_s_per_gpu", out["train_tokens_per_s"])
        add("perf/train_time_s", train_time)
        self.metrics.maybe_log(self.step, self.tokens_seen, self.schedule.lr_at(self.step - 1))

    def _nonfinite_stop(self) -> NonFiniteLossError:
        """Checkpoint the last good state (no gradient of this step kept) and return the error to
        raise."""
        path = self.save()
        return NonFiniteLossError(f"non-finite {self.divergence} at step {self.step + 1} "
                                  f"({self.nonfinite.stop_reason()}); the last good state is saved "
                                  f"in {path}. Lower optim.lr before resuming.")

    # ------------------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean divergence (reverse KL by default) per sampled token of held-out rollouts (fixed
        sampling seed)."""
        prompts = self.curriculum.heldout()[self.rank::self.world]
        if not self.curriculum.heldout():
            return None
        opd = self.cfg.opd
        horizon = opd.eval_horizon or opd.horizon_start
        gen = torch.Generator(device=self.device)
        gen.manual_seed(10_000 + opd.seed * 1000 + self.rank)
        bs = opd.rollout_batch_size or self.cfg.data.micro_batch_size
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        model, scorer = self._generation_model(), self._scoring_module()
        self.module.student.eval()
        try:
            for i in range(0, len(prompts), bs):
                chunk = prompts[i:i + bs]
                gens = sample_rollouts(model, chunk, horizon, temperature=opd.temperature,
                                       top_p=opd.top_p, eos_token_id=self.eos,
                                       pad_token_id=self.pad, stop_at_eos=opd.stop_at_eos,
                                       generator=gen, static_cache=opd.static_decode,
                                       compile_static=self._compile_rollouts,
                                       decoder_options=self.rollout_decoder_options)
                rs = [Rollout(p, g) for p, g in zip(chunk, gens) if g]
                if not rs:
                    continue
                b = pack_rollouts(rs).to(self.device)
                _, kl, count, _ = scorer(b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen,
                                         b.loss_mask, b.gen_index, horizon=horizon)
                sums += torch.stack([kl.double(), count.double()])
        finally:
            self.module.student.train()
        dist.all_reduce(sums)
        value = float(sums[0] / sums[1].clamp_min(1))
        self.eval_history.append((self.step, value))
        self.metrics.log_eval(self.step, {f"eval/{self.objective}": value})
        return value

    # ------------------------------------------------------------- around the steps (Trainer.train)
    def _start_training(self, total: int) -> None:
        self._resumed_at = self.step
        if self.step == 0:
            self.evaluate()

    def _after_step(self, total: int) -> None:
        self._maybe_snapshot()
        every = self.cfg.opd.eval_every
        if every and self.step % every == 0 and self.step < total:
            self.evaluate()

    def _end_training(self) -> None:
        if self.step > self._resumed_at:  # a finished run started again evaluated this step before
            self.evaluate()
        self.save()

    def finish(self) -> Path | None:
        """Write the student as an HF HypeNet folder under ``<run_dir>/final`` (rank 0)."""
        from ..models.export import write_hf_folder
        from ..stages import export_generation_config, run_record, stage_inputs

        out = None
        student = self._generation_model()  # under ZeRO-3 the gathered replica (collective)
        try:
            if self.rank == 0:
                folder = Path(self.cfg.logging.run_dir) / "final"
                record = run_record(self.cfg, self.step, self.tokens_seen, self.metrics,
                                    horizon=self.horizon.horizon)
                out = write_hf_folder(student.state_dict(), student.config, folder,
                                      tokenizer=self.tokenizer, record=record,
                                      generation_config=export_generation_config(self.cfg),
                                      overwrite=True, inputs=stage_inputs(self.cfg))
        finally:  # a failed write (disk full) still meets the other ranks here, then raises
            self.metrics.close()
            _barrier()
        return out


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

