"""The on-policy distillation loop (OPAL, SPEC §3); the stage's pieces are in ``halo_dist.stages.opd``.

Per optimizer step on every rank: sample ``global_batch / dp`` prompts from the curriculum ->
student rollouts at the current horizon -> pack into ``grad_accum`` micro-batches -> all-reduce the
generated-token count N -> per micro-batch: teacher scores, fused reverse KL / (N / world), backward
-> all-reduce gradients (mean over ranks), clip, AdamW step with per-group LRs on the run's schedule
-> all-reduce the step's KL sum -> the plateau detector may double the horizon.

Backend: ``opd.backend: torch`` (the path implemented and tested here) keeps a full replica of the
student per rank (plain data parallelism: gradients all-reduced by this loop, AdamW from torch;
HypeNet-2B's student + AdamW state is ~28 GB, which fits one H200 next to the bf16 teacher). For
students that need sharding, wrap ``OPDModule`` in DeepSpeed ZeRO exactly as ``engine.Trainer`` wraps
``DistillModule`` (``parallel.deepspeed_setup.initialize_engine`` with these parameter groups and a
``LambdaLR`` of the schedule, ``enable_zero3()`` for the lm_head, normaliser ``N / (grad_accum * dp)``,
lock-step generation): ``opd.backend: deepspeed`` is accepted by the config but refused here until that
path is measured (see the README section).

Checkpoints (``<checkpoint.dir>/step-*``, ``COMPLETE`` marker, ``keep_last`` kept) hold the student,
optimizer, LR-scheduler step, schedule description, horizon/detector state, per-rank curriculum and
sampling RNG states: a resumed run continues bit-exactly. Pre-decay snapshots (``<run_dir>/snapshots``,
never pruned) are written every ``opd.snapshot_every`` steps while the LR is pre-decay and always at the
WSD decay start; ``opd.resume_from=<snapshot>`` with a larger ``schedule.total_steps`` continues a run
as the next rung (:meth:`LRSchedule.check_resume` refuses anything that would change past LRs).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import format_config, save_resolved
from ..config.schema import RunConfig
from ..stages.opd import (HorizonSchedule, OPDModule, Rollout, bucket_tag, check_tokenizers, check_vocab,
                          pack_rollouts, parameter_groups, position_buckets, sample_rollouts)
from ..stages.opd_prompts import ByteTokenizer, Curriculum
from .checkpoint import MARKER, TRAINER_STATE, _atomic_text, complete_checkpoints, latest_checkpoint, rng_state, \
    set_rng_state, step_dir_name
from .metrics import MetricsLogger, flops_per_token
from .schedules import LRSchedule


class NonFiniteLossError(RuntimeError):
    """The loss became NaN/inf; the last good state was checkpointed before raising."""


# ------------------------------------------------------------------------------------------------
# Building the models
# ------------------------------------------------------------------------------------------------


def load_tokenizer(cfg: RunConfig):
    """``opd.tokenizer`` ("bytes" or a folder / hub id), else the teacher's; random teachers need one."""
    name = cfg.opd.tokenizer
    if name == "bytes":
        return ByteTokenizer()
    if name is None and cfg.model.teacher == "random":
        raise ValueError("a random teacher has no tokenizer: set opd.tokenizer (e.g. 'bytes' for tiny tests)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name or cfg.model.teacher)


def student_tokenizer(cfg: RunConfig):
    """The tokenizer saved with ``model.student_init`` (HF folder), if any."""
    init = cfg.model.student_init
    if not init or not Path(init).is_dir() or not any(Path(init).glob("tokenizer*")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(init, trust_remote_code=True)


def build_models(cfg: RunConfig, hf_teacher=None, student=None, tokenizer=None):
    """``(student HypeNet, frozen exact teacher, tokenizer)`` with vocabulary/tokenizer checks."""
    from ..models.convert import convert_model
    from ..models.hypenet import HypeNetForCausalLM
    from ..stages import student_overrides
    from ..stages.stage1 import resolve_stage1_file
    from ..stages.teacher import as_exact_hypenet, load_hf_teacher

    tokenizer = tokenizer or load_tokenizer(cfg)
    hf_teacher = hf_teacher if hf_teacher is not None else load_hf_teacher(cfg.model)
    teacher = as_exact_hypenet(hf_teacher)
    if student is None:
        if cfg.model.student_init:
            check_tokenizers(tokenizer, student_tokenizer(cfg))
            student = HypeNetForCausalLM.from_pretrained(cfg.model.student_init, dtype=torch.float32)
        else:
            s1 = resolve_stage1_file(cfg.model.stage1_weights) if cfg.model.stage1_weights else None
            student = convert_model(hf_teacher, cfg.model.attn_layers, stage1_weights=s1, **student_overrides(cfg))
    check_vocab(student, teacher, tokenizer)
    return student, teacher, tokenizer


def ensure_process_group() -> None:
    """A 1-rank group for a plain ``python launchers/opd.py``; torchrun's env otherwise."""
    from .engine import ensure_distributed_env

    if dist.is_initialized():
        return
    ensure_distributed_env()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


# ------------------------------------------------------------------------------------------------
# The trainer
# ------------------------------------------------------------------------------------------------


class OPDTrainer:
    """Builds everything from a validated RunConfig (stage ``opd``); ``train()`` runs the loop."""

    def __init__(self, cfg: RunConfig, argv=None, *, hf_teacher=None, student=None, tokenizer=None, prompt_sets=None):
        if cfg.opd is None:
            raise ValueError("the OPD trainer needs an opd: section (stage.name: opd)")
        if cfg.opd.backend != "torch":
            raise ValueError("opd.backend=deepspeed is not implemented yet; use opd.backend=torch (plain data "
                             "parallelism, see halo_dist/train/opd_loop.py)")
        self.cfg, self.argv = cfg, argv
        self._inject = dict(hf_teacher=hf_teacher, student=student, tokenizer=tokenizer)
        self._prebuilt = prompt_sets
        self.step = 0
        self.tokens_seen = 0  # generated (trained) tokens, all ranks
        self.eval_history: list[tuple[int, float]] = []

    # ------------------------------------------------------------------------------ setup
    def setup(self) -> "OPDTrainer":
        cfg, opd = self.cfg, self.cfg.opd
        ensure_process_group()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.layout = cfg.validate_against_world(self.world)
        self.device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        student, teacher, self.tokenizer = build_models(cfg, **self._inject)
        if cfg.model.activation_checkpointing:
            student.model.gradient_checkpointing = True
        self.eos = opd.eos_token_id if opd.eos_token_id is not None else getattr(self.tokenizer, "eos_token_id", None)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad = pad if pad is not None else (self.eos if self.eos is not None else 0)
        self.buckets = position_buckets(opd.kl_bucket_min, opd.horizon_max)
        self.module = OPDModule(student.to(self.device, self.dtype), teacher.to(self.device, self.dtype),
                                temperature=cfg.loss.temperature, chunk_size=cfg.loss.chunk_size, buckets=self.buckets)
        self.module.train()
        o = cfg.optim
        self.groups = parameter_groups(student, lr=o.lr, rnn_lr=opd.rnn_lr, attn_lr=opd.attn_lr,
                                       other_lr=opd.other_lr, train_attention=opd.train_attention)
        self.params = [p for g in self.groups for p in g["params"]]
        self.optimizer = torch.optim.AdamW(self.groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay, fused=self.device.type == "cuda")
        self.schedule = LRSchedule.from_config(cfg)
        # Every group's LR = its peak x the schedule's multiplier (shape shared, peaks per group).
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule.multiplier)
        self.horizon = HorizonSchedule.from_config(opd)
        vocab = student.config.vocab_size
        self.curriculum = Curriculum(opd, self.tokenizer, vocab, rank=self.rank, prebuilt=self._prebuilt)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(opd.seed * 1000 + self.rank)
        self.ckpt_root = Path(cfg.checkpoint_dir)
        self.snap_root = Path(cfg.logging.run_dir) / "snapshots"
        self._maybe_resume()
        self._start_metrics()
        return self

    def _start_metrics(self) -> None:
        n_train = sum(p.numel() for p in self.params)
        n_teacher = sum(p.numel() for p in self.module.teacher.parameters())
        self.metrics = MetricsLogger.from_config(
            self.cfg, rank=self.rank, world_size=self.world, device=self.device,
            flops_per_token=flops_per_token(n_train, n_teacher), start_step=self.step, start_tokens=self.tokens_seen)
        if self.rank == 0:
            Path(self.cfg.logging.run_dir).mkdir(parents=True, exist_ok=True)
            save_resolved(self.cfg, Path(self.cfg.logging.run_dir) / "config.yaml", argv=self.argv)
            print(format_config(self.cfg), flush=True)

    # ------------------------------------------------------------------------------ state
    def _trainer_state(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "schedule": self.schedule.state_dict(),
                "horizon": self.horizon.state_dict(), "world_size": self.world, "stage": "opd",
                "teacher": self.cfg.model.teacher, "eval_history": self.eval_history,
                "student_config": self.module.student.config.to_dict()}

    def save(self, root: Path | None = None, keep_last: int | None = None) -> Path:
        """Collective save to ``root/step-N`` (checkpoints by default); rank 0 writes model and optimizer."""
        root = Path(root or self.ckpt_root)
        path = root / step_dir_name(self.step)
        if self.rank == 0:
            if path.exists():
                shutil.rmtree(path)
            path.mkdir(parents=True)
        _barrier()
        local = {"rng": rng_state(), "generator": self.generator.get_state(), "curriculum": self.curriculum.state_dict()}
        torch.save(local, path / f"rng_rank{self.rank:05d}.pt")
        if self.rank == 0:
            torch.save({"model": self.module.student.state_dict(), "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict()}, path / "state.pt")
            _atomic_text(path / TRAINER_STATE, json.dumps(self._trainer_state(), indent=2))
            cfg_file = Path(self.cfg.logging.run_dir) / "config.yaml"
            _atomic_text(path / "config.yaml", cfg_file.read_text() if cfg_file.exists() else "")
        _barrier()
        if self.rank == 0:
            _atomic_text(path / MARKER, json.dumps({"step": self.step}))
            if keep_last:
                done = complete_checkpoints(root)
                for old in done[:-keep_last]:
                    shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return path

    def load(self, path: Path, rung: bool = False) -> None:
        """Restore everything saved by :meth:`save`; ``rung``: a snapshot continued with a new schedule."""
        path = Path(path)
        if not (path / MARKER).exists():
            raise FileNotFoundError(f"{path} is not a complete OPD checkpoint/snapshot (no {MARKER} marker)")
        state = json.loads((path / TRAINER_STATE).read_text())
        if state.get("stage") != "opd":
            raise ValueError(f"{path} is a {state.get('stage')} checkpoint, not an OPD one")
        saved = LRSchedule.from_state_dict(state["schedule"])
        if rung and not saved.is_pre_decay(state["step"]):
            raise ValueError(f"{path} was taken at step {state['step']}, after its schedule's decay started "
                             f"(step {saved.decay_start}): only pre-decay snapshots can start a rung")
        self.schedule.check_resume(state["schedule"], state["step"])
        if state["world_size"] != self.world:
            raise ValueError(f"{path} was written by {state['world_size']} ranks; this run has {self.world}")
        blob = torch.load(path / "state.pt", map_location=self.device, weights_only=True)
        self.module.student.load_state_dict(blob["model"])
        self.optimizer.load_state_dict(blob["optimizer"])
        self.scheduler.load_state_dict(blob["scheduler"])
        local = torch.load(path / f"rng_rank{self.rank:05d}.pt", weights_only=False)
        set_rng_state(local["rng"])
        self.generator.set_state(local["generator"])
        self.curriculum.load_state_dict(local["curriculum"])
        self.horizon.load_state_dict(state["horizon"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.eval_history = [tuple(e) for e in state.get("eval_history", [])]
        if self.rank == 0:
            print(f"{'rung from' if rung else 'resumed from'} {path} at step {self.step} "
                  f"(horizon {self.horizon.horizon}, {self.tokens_seen} on-policy tokens)", flush=True)

    def _maybe_resume(self) -> None:
        latest = latest_checkpoint(self.ckpt_root) if self.cfg.checkpoint.resume == "auto" else None
        if latest is not None:
            self.load(latest)
        elif self.cfg.opd.resume_from:
            self.load(Path(self.cfg.opd.resume_from), rung=True)

    def _maybe_snapshot(self) -> None:
        s, opd = self.step, self.cfg.opd
        if not self.schedule.is_pre_decay(s):
            return
        at_decay = self.schedule.kind == "wsd" and s == self.schedule.decay_start
        if at_decay or (opd.snapshot_every and s % opd.snapshot_every == 0):
            self.save(self.snap_root)

    # ------------------------------------------------------------------------------ one step
    def _rollouts(self, n: int, horizon: int) -> tuple[list[Rollout], float]:
        opd = self.cfg.opd
        picks = self.curriculum.sample(n, self.step, horizon)
        bs = opd.rollout_batch_size or self.cfg.data.micro_batch_size
        t0 = time.perf_counter()
        out = []
        for i in range(0, n, bs):
            chunk = picks[i:i + bs]
            gens = sample_rollouts(self.module.student, [p for _, p in chunk], horizon, temperature=opd.temperature,
                                   top_p=opd.top_p, eos_token_id=self.eos, pad_token_id=self.pad,
                                   stop_at_eos=opd.stop_at_eos, generator=self.generator)
            out += [Rollout(p, g, name) for (name, p), g in zip(chunk, gens)]
        _sync(self.device)
        return out, time.perf_counter() - t0

    def train_step(self) -> dict:
        """One optimizer step; returns the step's global reverse KL and counts."""
        layout, horizon = self.layout, self.horizon.horizon
        per_rank = layout.micro_batch_size * layout.grad_accum_steps
        rollouts, gen_time = self._rollouts(per_rank, horizon)
        m = layout.micro_batch_size
        micro = [rollouts[i:i + m] for i in range(0, per_rank, m)]
        micro = [pack_rollouts(mb).to(self.device) if any(r.completion for r in mb) else None for mb in micro]
        local = sum(p.num_generated for p in micro if p is not None)
        counts = torch.tensor([float(local)], device=self.device, dtype=torch.float64)
        dist.all_reduce(counts)
        n_global = max(1.0, float(counts.item()))
        normalizer = n_global / self.world  # gradients are averaged over the world below
        t0 = time.perf_counter()
        kl_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        bucket_sums = [[torch.zeros((), device=self.device, dtype=torch.float64), 0] for _ in self.buckets]
        train_tokens = 0
        for batch in micro:
            if batch is None:
                continue
            loss, kl, count, per_bucket = self.module(
                batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen, batch.loss_mask,
                batch.gen_index, normalizer=normalizer, horizon=horizon)
            if os.environ.get("HALO_TEST_NAN_AT_STEP") == str(self.step + 1):
                loss = loss * float("nan")
            self._check_finite(loss)
            loss.backward()
            kl_sum += kl.double()
            train_tokens += batch.input_ids.shape[1]
            for i, (s, c) in enumerate(per_bucket):
                bucket_sums[i][0] += s.double()
                bucket_sums[i][1] += c
        grad_norm = self._reduce_and_step()
        _sync(self.device)
        train_time = time.perf_counter() - t0
        red = torch.stack([kl_sum] + [b[0] for b in bucket_sums]
                          + [torch.as_tensor(b[1], dtype=torch.float64, device=self.device) for b in bucket_sums])
        dist.all_reduce(red)
        red = red.tolist()
        nb = len(self.buckets)
        kl_mean = red[0] / n_global
        self.step += 1
        self.tokens_seen += int(n_global)
        out = {"kl": kl_mean, "tokens": n_global, "horizon": horizon, "grad_norm": grad_norm,
               "gen_tokens_per_s": local / max(gen_time, 1e-9), "train_tokens_per_s": train_tokens / max(train_time, 1e-9),
               "buckets": {self.buckets[i]: (red[1 + i], red[1 + nb + i]) for i in range(nb)}}
        self._log_step(out, local, gen_time, train_tokens, train_time)
        if self.horizon.update(self.step, kl_mean) and self.rank == 0:
            print(f"step {self.step}: reverse KL plateaued at horizon {horizon} -> horizon {self.horizon.horizon}",
                  flush=True)
        return out

    def _reduce_and_step(self) -> float:
        allreduce_mean_grads(self.params, self.world)
        clip = self.cfg.optim.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.params, clip if clip is not None else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def _log_step(self, out: dict, gen_tokens: int, gen_time: float, train_tokens: int, train_time: float) -> None:
        add = self.metrics.add
        add("train/loss", out["kl"], weight=out["tokens"])
        add("train/reverse_kl", out["kl"], weight=out["tokens"])
        for (lo, hi), (s, c) in out["buckets"].items():
            if lo < out["horizon"]:
                add(bucket_tag(lo, hi), s / max(c, 1.0), weight=c)
        add("progress/horizon", float(out["horizon"]))
        add("progress/gen_tokens_per_rollout", out["tokens"] / self.layout.global_batch_size)
        add("optim/grad_norm", out["grad_norm"])
        for g in self.optimizer.param_groups:
            add(f"optim/lr_{g['name']}", self.schedule.multiplier(self.step - 1) * g["initial_lr"])
        add("perf/rollout_tokens_per_s_per_gpu", out["gen_tokens_per_s"])
        add("perf/train_tokens_per_s_per_gpu", out["train_tokens_per_s"])
        add("perf/rollout_time_s", gen_time)
        add("perf/train_time_s", train_time)
        self.metrics.maybe_log(self.step, self.tokens_seen, self.schedule.lr_at(self.step - 1))

    def _check_finite(self, loss: torch.Tensor) -> None:
        bad = torch.tensor([0.0 if torch.isfinite(loss).all() else 1.0], device=self.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item() > 0:
            self.optimizer.zero_grad(set_to_none=True)
            path = self.save(keep_last=self.cfg.checkpoint.keep_last)
            raise NonFiniteLossError(f"non-finite reverse KL at step {self.step + 1}; the last good state is "
                                     f"saved in {path}. Lower optim.lr before resuming.")

    # ------------------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean reverse KL per sampled token on the held-out prompts (fixed sampling seed)."""
        prompts = self.curriculum.heldout()[self.rank::self.world]
        if not self.curriculum.heldout():
            return None
        opd = self.cfg.opd
        horizon = opd.eval_horizon or opd.horizon_start
        gen = torch.Generator(device=self.device)
        gen.manual_seed(10_000 + opd.seed * 1000 + self.rank)
        bs = opd.rollout_batch_size or self.cfg.data.micro_batch_size
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        self.module.student.eval()
        try:
            for i in range(0, len(prompts), bs):
                chunk = prompts[i:i + bs]
                gens = sample_rollouts(self.module.student, chunk, horizon, temperature=opd.temperature, top_p=opd.top_p,
                                       eos_token_id=self.eos, pad_token_id=self.pad, stop_at_eos=opd.stop_at_eos,
                                       generator=gen)
                rs = [Rollout(p, g) for p, g in zip(chunk, gens) if g]
                if not rs:
                    continue
                b = pack_rollouts(rs).to(self.device)
                _, kl, count, _ = self.module(b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen, b.loss_mask,
                                              b.gen_index, horizon=horizon)
                sums += torch.stack([kl.double(), count.double()])
        finally:
            self.module.student.train()
        dist.all_reduce(sums)
        value = float(sums[0] / sums[1].clamp_min(1))
        self.eval_history.append((self.step, value))
        self.metrics.log_eval(self.step, {"eval/reverse_kl": value})
        return value

    # ------------------------------------------------------------------------------ the loop
    def train(self) -> dict:
        cfg, total = self.cfg, self.cfg.total_steps
        last = {}
        if self.step == 0:
            self.evaluate()
        while self.step < total:
            last = self.train_step()
            every = cfg.checkpoint.every_steps
            if every and self.step % every == 0 and self.step < total:
                self.save(keep_last=cfg.checkpoint.keep_last)
            self._maybe_snapshot()
            if cfg.opd.eval_every and self.step % cfg.opd.eval_every == 0 and self.step < total:
                self.evaluate()
        self.evaluate()
        self.save(keep_last=cfg.checkpoint.keep_last)
        return last

    def finish(self) -> Path | None:
        """Write the student as an HF HypeNet folder under ``<run_dir>/final`` (rank 0)."""
        from ..models.export import export_hypenet

        out = None
        if self.rank == 0:
            folder = Path(self.cfg.logging.run_dir) / "final"
            student = self.module.student
            tok = None if isinstance(self.tokenizer, ByteTokenizer) else self.tokenizer
            out = export_hypenet(student.float(), folder, tokenizer=tok,
                                 extra={"stage": "opd", "step": self.step, "horizon": self.horizon.horizon})
            (folder / "DONE").write_text(json.dumps({"stage": "opd", "step": self.step}))
        self.metrics.close()
        _barrier()
        return out


def allreduce_mean_grads(params: list, world: int) -> None:
    """Average gradients over the ranks (one flat fp32 all-reduce); a missing gradient counts as 0.

    With every micro-batch loss divided by ``N_global / world`` this makes the update the gradient
    of the global per-token mean (token-weighted DP reduction).
    """
    if world <= 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
        offset += n


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_opd(cfg: RunConfig, argv=None, **inject) -> Path | None:
    """Entry point of ``launchers/opd.py``: build, train, write the student."""
    trainer = OPDTrainer(cfg, argv, **inject)
    trainer.setup()
    t0 = time.time()
    trainer.train()
    out = trainer.finish()
    if trainer.rank == 0:
        print(f"opd finished in {time.time() - t0:.1f}s -> {out}", flush=True)
    return out
