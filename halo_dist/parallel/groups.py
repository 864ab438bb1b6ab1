"""Process-group arithmetic (data parallel x Ulysses sequence parallel) and DeepSpeed's ``mpu``.

Layout: ``world = dp * sp``. Global rank ``r`` sits at
``(dp_rank, sp_rank) = (r // sp, r % sp)``, so every sequence-parallel (SP) group is a block of
*consecutive* ranks -- launchers number ranks node by node, so an SP group (whose all-to-alls run
in every attention/RNN layer) stays inside one node -- and the data-parallel (DP) groups are strided
across nodes. ``ParallelLayout`` holds the pure arithmetic (unit-tested without processes);
``ProcessGroups`` builds the ``torch.distributed`` groups once and is the ``mpu`` handed to
``deepspeed.initialize(mpu=...)``.

What DeepSpeed 0.19.8 asks of an ``mpu`` (read from ``runtime/engine.py``, ``runtime/config.py``,
``utils/groups.py``, ``utils/bwc.py``, ``runtime/zero/{stage3,parameter_offload}.py``,
``runtime/utils.py``, ``runtime/model_checkpointing/utils.py``):

* ``get_data_parallel_world_size()`` -- ``DeepSpeedConfig`` batch arithmetic
  (``train_batch = micro * grad_accum * this``) and the engine's ``dp_world_size`` (its data
  sampler, ``set_train_batch_size``). SP ranks of one group consume the *same* sample, so this is
  the pure DP size.
* ``get_data_parallel_rank()``, ``get_data_parallel_group()``, ``get_data_parallel_group_ranks()``
  -- sampler, checkpoint writer info, overflow check; and, for ZeRO-3, the group that
  ``DeepSpeedZeRoOffload._convert_to_zero_parameters`` partitions a not-yet-partitioned module over.
  That last use is the trap: the ZeRO-3 optimizer partitions and reduces over the
  sequence-data-parallel group, so with ``sp > 1`` the module must already be partitioned over
  that group before ``deepspeed.initialize`` (``deepspeed_setup.initialize_engine`` does it).
* ``get_sequence_parallel_{group,world_size,rank}()`` -- the engine's ``sequence_parallel_size``,
  which sets how gradients are scaled over SP ranks (summed in stages 0-2, but averaged by ZeRO-3's
  reduce-scatter: see ``deepspeed_setup.sp_loss_factor``).
* ``get_sequence_data_parallel_{group,world_size,rank}()`` -- the group ZeRO shards parameters,
  gradients and optimizer state over, gradients are reduced over and the model is broadcast over:
  all ``dp * sp`` ranks.
* ``get_model_parallel_{group,world_size,rank}()``, ``get_tensor_model_parallel_{group,world_size,
  rank,src_rank}()``, ``get_pipeline_model_parallel_{group,world_size,rank}()`` -- grad-norm and
  overflow all-reduces, checkpoint names, universal checkpoints. There is no TP/PP here: they are
  a single-rank group, size 1, rank 0. (Aliasing model-parallel to SP, as DeepSpeed's own
  ``parallel_state_sp`` does, would sum the already-reduced gradient norm over SP ranks.)
* The object must **not** have ``initialize_sequence_parallel``: DeepSpeed takes its presence to
  mean "DeepSpeed's own ``parallel_state_sp`` module" and then ignores the DP methods
  (``utils/groups.py::_get_data_parallel_group`` returns ``None``).
* Do not also put both ``sequence_parallel_size`` and ``data_parallel_size`` in the DeepSpeed JSON:
  ``deepspeed.initialize`` then builds its own device mesh instead of using the mpu.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ..errors import HaloUserError


class LayoutError(HaloUserError, ValueError):
    """A parallel layout that cannot work (sizes not divisible, rank out of range, ...)."""


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Pure arithmetic of ``world = dp * sp`` with SP groups of consecutive ranks.

    Args:
        world_size: number of ranks.
        sp_size: Ulysses sequence-parallel degree (ranks sharing one sequence).
    """

    world_size: int
    sp_size: int = 1

    def __post_init__(self):
        for name in ("world_size", "sp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name} must be a positive int, got {value!r}")
        if self.world_size % self.sp_size:
            raise LayoutError(f"world_size={self.world_size} is not divisible by sp_size={self.sp_size}; "
                              f"world = dp * sp needs sp to divide the number of ranks")

    @property
    def dp_size(self) -> int:
        """Number of model replicas that read different data."""
        return self.world_size // self.sp_size

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} out of range for world_size={self.world_size}")

    def coords(self, rank: int) -> tuple[int, int]:
        """Global rank -> ``(dp_rank, sp_rank)``."""
        self._check_rank(rank)
        return divmod(rank, self.sp_size)

    def rank_of(self, dp_rank: int, sp_rank: int) -> int:
        """``(dp_rank, sp_rank)`` -> global rank (inverse of :meth:`coords`)."""
        if not (0 <= dp_rank < self.dp_size and 0 <= sp_rank < self.sp_size):
            raise LayoutError(f"(dp_rank={dp_rank}, sp_rank={sp_rank}) outside dp={self.dp_size} x sp={self.sp_size}")
        return dp_rank * self.sp_size + sp_rank

    def sp_group_ranks(self, dp_rank: int) -> list[int]:
        """Global ranks of the SP group of replica ``dp_rank`` (consecutive)."""
        return [self.rank_of(dp_rank, s) for s in range(self.sp_size)]

    def dp_group_ranks(self, sp_rank: int) -> list[int]:
        """Global ranks holding sequence shard ``sp_rank`` of every replica (stride ``sp``)."""
        return [self.rank_of(d, sp_rank) for d in range(self.dp_size)]

    def all_sp_groups(self) -> list[list[int]]:
        return [self.sp_group_ranks(d) for d in range(self.dp_size)]

    def all_dp_groups(self) -> list[list[int]]:
        return [self.dp_group_ranks(s) for s in range(self.sp_size)]


def _new_groups(rank_lists: list[list[int]], rank: int, timeout: Optional[timedelta]):
    """Create every group in ``rank_lists`` (all ranks must call this in the same order); return ours."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks=ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine


class ProcessGroups:
    """The DP / SP / DP x SP process groups, built once; also DeepSpeed's ``mpu``.

    Build with :meth:`build` after ``torch.distributed`` is initialised (every rank must call it,
    in the same order relative to other group creation). Attributes ``layout``, ``rank``,
    ``dp_rank``, ``sp_rank``, ``dp_group``, ``sp_group``, ``sdp_group`` (all ranks, what ZeRO
    shards over) and ``self_group`` (this rank alone; the trivial TP/PP group).
    """

    def __init__(self, layout: ParallelLayout, rank: int, dp_group, sp_group, sdp_group, self_group):
        self.layout = layout
        self.rank = rank
        self.dp_rank, self.sp_rank = layout.coords(rank)
        self.dp_group, self.sp_group = dp_group, sp_group
        self.sdp_group, self.self_group = sdp_group, self_group

    @classmethod
    def build(cls, sp_size: int = 1, timeout: Optional[timedelta] = None) -> "ProcessGroups":
        """Validate the layout against the running world and create all groups (collective)."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call init_process_group first")
        layout = ParallelLayout(dist.get_world_size(), sp_size)
        rank = dist.get_rank()
        sp_group = _new_groups(layout.all_sp_groups(), rank, timeout)
        dp_group = _new_groups(layout.all_dp_groups(), rank, timeout)
        # A fresh all-rank group rather than WORLD: DeepSpeed's get_all_ranks_from_group loops
        # until get_global_rank raises, which never happens for WORLD.
        sdp_group = _new_groups([list(range(layout.world_size))], rank, timeout)
        self_group = _new_groups([[r] for r in range(layout.world_size)], rank, timeout)
        return cls(layout, rank, dp_group, sp_group, sdp_group, self_group)

    def __repr__(self):
        return (f"ProcessGroups(world={self.layout.world_size}, dp={self.layout.dp_size}, "
                f"sp={self.layout.sp_size}, rank={self.rank}, dp_rank={self.dp_rank}, sp_rank={self.sp_rank})")

    # --- data parallel: replicas reading different samples ---------------------------------
    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.layout.dp_size

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.layout.dp_group_ranks(self.sp_rank)

    # --- sequence parallel: ranks sharing one sequence (consecutive) -----------------------
    def get_sequence_parallel_group(self):
        return self.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.layout.sp_size

    def get_sequence_parallel_rank(self) -> int:
        return self.sp_rank

    def get_sequence_parallel_group_ranks(self) -> list[int]:
        return self.layout.sp_group_ranks(self.dp_rank)

    # --- sequence x data parallel: what ZeRO shards over and reduces gradients over --------
    def get_sequence_data_parallel_group(self):
        return self.sdp_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.layout.world_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.rank

    # --- model (tensor / pipeline) parallel: none, a single-rank group ----------------------
    def get_model_parallel_group(self):
        return self.self_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_pipeline_model_parallel_group = get_model_parallel_group
    get_pipeline_model_parallel_world_size = get_model_parallel_world_size
    get_pipeline_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's (trivial) TP group: this rank."""
        return self.rank
