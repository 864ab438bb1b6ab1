"""DeepSpeed start-up that works the same on CPU (gloo, tests, CI) and GPU (NCCL).

CPU pitfalls handled here: ``DS_ACCELERATOR=cpu`` must be set before
DeepSpeed is imported; DeepSpeed's ``TorchBackend`` JIT-compiles a shared-memory op (~75 s) on
first ``init_distributed`` unless ``build_shm_op`` is replaced by a no-op on the *module object*
``sys.modules["deepspeed.comm.torch"]`` (``import deepspeed.comm.torch as m`` binds the
``torch`` package instead); without ``"torch_adam": true`` it compiles FusedAdam.

ZeRO-3 with Ulysses SP (DeepSpeed 0.19.8): the optimizer partitions and reduces over
``mpu.get_sequence_data_parallel_group()`` (all dp*sp ranks), but a module whose parameters are
not yet ZeRO parameters is partitioned inside ``deepspeed.initialize`` over
``mpu.get_data_parallel_group()`` (pure DP). With sp > 1 the two disagree, so
:func:`initialize_engine` first partitions the module over the sequence-data-parallel group with
``deepspeed.zero.Init(module=...)`` (which keeps the existing weights), then checks every
parameter's partition group. Measured on 2 CPU ranks with sp=2: without that step DeepSpeed raises
nothing, leaves the parameters unpartitioned and trains wrongly (parameters off by 4e-2 after two
AdamW steps of a toy Ulysses block, against 1e-6 with it).

Gradient scale with SP (DeepSpeed 0.19.8, measured here and in
``tests/test_parallel_deepspeed.py``): stages 0-2 divide the gradient sum over all ``dp*sp`` ranks
by ``dp`` (sum over SP, mean over DP), but ZeRO-3's default reduce-scatter path
(``reduce_scatter: true``) averages over all ``dp*sp`` ranks, so the gradient -- and the norm that
clipping uses -- comes out ``1/sp`` of the true one (seen with sp=2: DeepSpeed's grad norm exactly
half the single-process norm; Adam hides most of it, clipping does not). With
``reduce_scatter: false`` ZeRO-3 picks per bucket by size between the two conventions, so it is
refused. Write each rank's loss as its share of the replica's loss (local token-loss sum / replica
token count) times :func:`sp_loss_factor`.

DeepSpeed's ``sequence_parallel_size`` JSON key is not needed when an mpu is passed (its batch
arithmetic reads ``mpu.get_data_parallel_world_size()``); don't combine it with
``data_parallel_size`` (that makes DeepSpeed build its own device mesh and ignore the mpu).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..config.coerce import ConfigError
from ..errors import IncompatibleInputError
from .groups import ProcessGroups
from .safe_load import install_safe_loading


def on_cpu() -> bool:
    """True when training runs without CUDA (tests, CI)."""
    return not torch.cuda.is_available()


def prepare_deepspeed(cpu: Optional[bool] = None) -> None:
    """Import DeepSpeed configured for this machine; on CPU select the CPU accelerator and skip
    the shared-memory op build. Idempotent; call before anything imports ``deepspeed``."""
    cpu = on_cpu() if cpu is None else cpu
    if cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.comm.torch  # noqa: F401  (registers the module in sys.modules)

    if cpu:
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    use_current_collectives()


def use_current_collectives() -> None:
    """Make DeepSpeed's comm backend call torch's renamed tensor collectives. Idempotent.

    DeepSpeed 0.19.8's ``TorchBackend`` binds ``torch.distributed.all_gather_into_tensor`` and
    ``reduce_scatter_tensor`` (ZeRO's parameter gathers and gradient reduce-scatters), which torch
    >= 2.12 deprecates: a FutureWarning each time something resets the warning filters (13 in a
    5-step 2-rank ZeRO-3 run, 43 in a 20-step one). ``all_gather_single`` /
    ``reduce_scatter_single`` take the same arguments. Patched on the class for backends made later
    (``deepspeed.initialize`` makes one when none exists) and on the backend that exists."""
    if not hasattr(dist, "all_gather_single"):  # torch 2.11: only the old names, which do not warn
        return
    # callers have set up DeepSpeed's import: prepare_deepspeed
    import deepspeed.comm.torch  # noqa: F401

    backend = sys.modules["deepspeed.comm.torch"].TorchBackend
    backend.get_all_gather_function = classmethod(lambda cls: dist.all_gather_single)
    backend.get_reduce_scatter_function = classmethod(lambda cls: dist.reduce_scatter_single)
    cdb = sys.modules["deepspeed.comm.comm"].cdb
    if isinstance(cdb, backend):
        cdb.all_gather_function, cdb.reduce_scatter_function = (dist.all_gather_single,
                                                                dist.reduce_scatter_single)


def start_distributed() -> None:
    """What every trainer's setup starts with: a 1-rank environment for a plain
    ``python launchers/X.py`` (torchrun's, deepspeed's or srun's otherwise), then torch.distributed
    and DeepSpeed's comm layer unless a process group exists (in-process tests;
    ``initialize_engine`` adopts it)."""
    from .env import ensure_distributed_env

    ensure_distributed_env()
    if not dist.is_initialized():
        init_distributed()


def init_distributed(timeout: timedelta = timedelta(minutes=10),
                     cpu: Optional[bool] = None) -> None:
    """Initialise torch.distributed and DeepSpeed's comm layer (gloo on CPU, NCCL on GPU)
    from the launcher's environment (torchrun / deepspeed / srun-exported RANK, WORLD_SIZE...)."""
    cpu = on_cpu() if cpu is None else cpu
    prepare_deepspeed(cpu)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo" if cpu else "nccl", timeout=timeout)


# The ZeRO stages whose checkpoints DeepSpeed 0.19.8 loads under one another: 1 and 2 (the same
# partitioned optimizer states). Measured on the tiny stage-2 run: 1 -> 2 and 2 -> 1 resume; 3 -> 0,
# 1 or 2 and 2 -> 3 fail in load_checkpoint with a bare AssertionError, 0 -> 1 with a missing file.
ZERO_CHECKPOINT_FORMATS = {0: "ZeRO 0 (whole optimizer states)",
                           1: "ZeRO 1/2 (partitioned optimizer states)",
                           2: "ZeRO 1/2 (partitioned optimizer states)",
                           3: "ZeRO 3 (partitioned parameters)"}


def check_resume_zero_stage(checkpoint: Path, zero_stage: int) -> None:
    """Refuse, before anything is built, to resume ``checkpoint`` under a ZeRO stage that cannot
    read it. The saved stage comes from the checkpoint's config.yaml (absent: the resume check
    refuses the checkpoint itself)."""
    from ..config.loader import read_yaml

    path = checkpoint / "config.yaml"
    if not path.is_file():
        return
    saved = read_yaml(path).get("config", {}).get("parallel", {}).get("zero_stage")
    if saved not in ZERO_CHECKPOINT_FORMATS or (ZERO_CHECKPOINT_FORMATS[saved]
                                                == ZERO_CHECKPOINT_FORMATS[zero_stage]):
        return
    raise IncompatibleInputError(
        f"parallel.zero_stage: {checkpoint} was written with parallel.zero_stage={saved}, this run "
        f"has {zero_stage}: DeepSpeed reads a {ZERO_CHECKPOINT_FORMATS[saved]} checkpoint only "
        f"under that format. Resume with parallel.zero_stage={saved}, or start a new run folder")


def partition_for_zero3(model: torch.nn.Module, groups: ProcessGroups,
                        ds_config: dict) -> torch.nn.Module:
    """Partition ``model``'s parameters over the sequence-data-parallel group (all ranks),
    keeping their values, so that ZeRO-3's parameter and optimizer partitions agree (module doc)."""
    import deepspeed

    deepspeed.zero.Init(module=model, data_parallel_group=groups.get_sequence_data_parallel_group(),
                        config_dict_or_path=ds_config, mpu=groups)
    return model


def zero_stage(ds_config: dict) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def check_zero3_partitioning(model: torch.nn.Module, groups: ProcessGroups) -> None:
    """Raise if a ZeRO-3 parameter is partitioned over a group other than all dp*sp ranks
    (DeepSpeed would then train silently wrong: measured, not assumed -- see module doc)."""
    want = groups.get_sequence_data_parallel_world_size()
    for name, param in model.named_parameters():
        group = getattr(param, "ds_process_group", None)
        if group is not None and dist.get_world_size(group) != want:
            raise RuntimeError(f"ZeRO-3 parameter {name!r} is partitioned over "
                               f"{dist.get_world_size(group)} ranks, but ZeRO-3 with {groups} must "
                               f"partition over all {want}; build the "
                               f"model under deepspeed.zero.Init(data_parallel_group="
                               "groups.get_sequence_data_parallel_group()) or normally (not under "
                               "zero.Init)")


def sp_loss_factor(ds_config: dict, groups: ProcessGroups) -> int:
    """Factor for each rank's loss share so that DeepSpeed's gradient is the replica's true
    gradient averaged over DP replicas: ``sp`` under ZeRO-3 (which averages over SP ranks too),
    else 1 (module doc). Raises for ZeRO-3 + SP with ``reduce_scatter: false``."""
    sp = groups.layout.sp_size
    if sp == 1 or zero_stage(ds_config) != 3:
        return 1
    if not ds_config.get("zero_optimization", {}).get("reduce_scatter", True):
        raise ConfigError("ZeRO-3 with sequence parallelism needs "
                          "zero_optimization.reduce_scatter=true: with false, DeepSpeed 0.19.8 "
                          "sums or averages gradients over SP ranks depending on bucket size")
    return sp


def frozen_teacher_zero3_config(micro_batch_size: int, grad_accum_steps: int,
                                global_batch_size: int, bf16: bool) -> dict:
    """DeepSpeed config of a frozen teacher sharded by ZeRO-3
    (``parallel.teacher_placement=zero3``).

    No optimizer and no gradients: ZeRO-3 only partitions the parameters over all dp*sp ranks, and
    the forward hooks gather each module's parameters just in time and free them after it
    (``stage3_param_persistence_threshold: 0``: no small parameter stays resident, so every rank
    holds exactly its 1/world share between forwards). The batch sizes must be the student engine's,
    which DeepSpeed checks (``train_batch_size = micro * grad_accum * dp``) even though the teacher
    never steps.
    Pass the result to :func:`initialize_engine` with the run's :class:`ProcessGroups`.
    """
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "train_batch_size": global_batch_size,
        "bf16": {"enabled": bool(bf16)},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }


def initialize_engine(model: torch.nn.Module, ds_config: dict, groups: ProcessGroups,
                      **kwargs: Any):
    """``deepspeed.initialize(model=model, config=ds_config, mpu=groups, **kwargs)``, after making
    ZeRO-3's parameter partitions span the sequence-data-parallel group; returns DeepSpeed's tuple
    ``(engine, optimizer, dataloader, lr_scheduler)``; the engine loads checkpoints with
    ``weights_only=True``. Works for a frozen teacher too (config without optimizer). ``kwargs``:
    ``optimizer=``, ``model_parameters=``, ``lr_scheduler=`` ..."""
    import deepspeed

    sp_loss_factor(ds_config, groups)  # validates the reduction convention
    # torch's process group may predate init_distributed (a caller's own init_process_group, the
    # multi-rank tests): deepspeed.initialize then makes DeepSpeed's comm backend itself, which on
    # CPU JIT-compiles the shared-memory op (~75 s, and every rank waits on one build lock: a build
    # killed midway leaves the lock and every later run hangs) unless prepare_deepspeed ran first
    prepare_deepspeed()
    if zero_stage(ds_config) == 3:
        if groups.layout.sp_size > 1:
            partition_for_zero3(model, groups, ds_config)
        check_zero3_partitioning(model, groups)
    out = deepspeed.initialize(model=model, config=ds_config, mpu=groups, **kwargs)
    install_safe_loading(out[0])  # checkpoints are read with weights_only=True (safe_load.py)
    keep_fp32_clip_norm(out[0])
    norm_is_the_overflow_check(out[1])
    return out


def keep_fp32_clip_norm(engine) -> None:
    """Make ``engine.get_global_grad_norm()`` answer on DeepSpeed's plain fp32 path (ZeRO 0, neither
    bf16 nor fp16, a torch optimizer): there ``clip_fp32_gradients`` computes the clipped norm with
    ``deepspeed.runtime.utils.clip_grad_norm_`` and drops it, so ``optim/grad_norm`` would read NaN.
    The replacement makes the same call and keeps the result where the mixed-precision optimizers
    keep theirs."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_and_keep() -> None:
        engine._global_grad_norm = clip_grad_norm_(parameters=engine.module.parameters(),
                                                   max_norm=engine.gradient_clipping(),
                                                   mpu=engine.mpu)

    engine.clip_fp32_gradients = clip_and_keep


def norm_is_the_overflow_check(optimizer) -> None:
    """ZeRO 1-2 in bf16 (DeepSpeed 0.19.8): check the gradients for inf/NaN once, through the
    gradient norm, as DeepSpeed already does in fp32.

    By default DeepSpeed's bf16 step makes two passes over every gradient tensor: an overflow check
    (amax, amin, two isfinite and two logical ops per tensor, then a host read), then the norm
    (each tensor cast to fp64, then its norm). Any inf or NaN element makes the norm inf or NaN,
    which the step already turns into the same skipped update, so the first pass adds nothing but
    kernel launches: on the 2B stage-2 step, ~2,000 launches and ~40 ms per step of an idle GPU
    waiting on the host (BENCHMARKS.md). Here the overflow check is left out and the norm is one
    foreach norm of every gradient, accumulated in fp32 (torch's ``clip_grad_norm_`` does the
    same), then DeepSpeed's own reduction over the data-parallel group and its inf/NaN sentinel.

    Left as DeepSpeed has it: ZeRO-3, optimizer offload, tensor parallelism (its norm counts only
    some parameters on some ranks), and steps without a gradient norm."""
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not (isinstance(optimizer, DeepSpeedZeroOptimizer) and optimizer.dtype == torch.bfloat16
            and optimizer.check_grad_overflow and optimizer.compute_grad_norm
            and not optimizer.cpu_offload and optimizer.model_parallel_world_size == 1):
        return

    def grad_norm(gradients, params, norm_type=2):
        if float(norm_type) != 2.0:
            return DeepSpeedZeroOptimizer.get_grad_norm_direct(optimizer, gradients, params,
                                                              norm_type)
        grads = [g.detach() for g in gradients if not getattr(g, "_zero_padding", False)]
        if grads:
            norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)  # per tensor, fp32
            total = torch.stack(norms).square().sum()
        else:
            total = torch.zeros((), dtype=torch.float32, device=optimizer.device)
        # this rank's partition -> the whole model's sum of squares
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=optimizer.dp_process_group)
        total = total.sqrt()
        mask_nan_or_inf_with_val_inplace(total, device=optimizer.device)  # inf/NaN -> -1: skip
        return total

    optimizer.check_overflow = lambda partition_gradients=True: None
    optimizer.get_grad_norm_direct = grad_norm
