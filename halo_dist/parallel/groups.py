"""The data-parallel x Ulysses sequence-parallel process groups, built by megatron-core, and
DeepSpeed's ``mpu``.

Layout: ``world = dp * sp``. Global rank ``r`` sits at
``(dp_rank, sp_rank) = (r // sp, r % sp)``, so every sequence-parallel (SP) group is a block of
*consecutive* ranks -- launchers number ranks node by node, so an SP group (whose all-to-alls run
in every attention/RNN layer) stays inside one node -- and the data-parallel (DP) groups are strided
across nodes. ``ParallelLayout`` holds the pure arithmetic (unit-tested without processes) and
validates a layout before any group exists.

``ProcessGroups.build`` has megatron-core's ``parallel_state.initialize_model_parallel`` create the
groups, with tensor and pipeline parallel sizes 1 and ``context_parallel_size = sp``: in megatron's
rank order ``tp-cp-ep-dp-pp`` its context-parallel (CP) groups are then blocks of consecutive ranks
and its data-parallel groups stride by ``sp``, which is the layout above (``build`` checks every
group's ranks against ``ParallelLayout`` and refuses a mismatch). Our SP group is megatron's CP
group, our DP group its data-parallel group without CP, the group ZeRO shards over its
data-parallel group with CP, and the trivial TP/PP group its model-parallel (TP x PP) group of one
rank. Megatron runs its own context-parallel attention over the CP group; here the group carries
our Ulysses all-to-alls instead: the same set of ranks, one sequence split over them.

``parallel_state`` is global state: a later ``build`` with the same layout and timeout in the same
world reuses its groups; another layout (or a world that was torn down and initialised again) has
it torn down and initialised again. Either way a ``ProcessGroups`` keeps the groups it was built
with, so one built earlier stays valid. ``build`` refuses to replace a ``parallel_state`` that other
code initialised. ``megatron.core`` is imported on the first ``build``, not with this module: the
import takes seconds (its package ``__init__`` loads megatron's layers, which pull in
``torch._dynamo`` and ``torch._inductor``).

``ProcessGroups`` is the small adapter handed to ``deepspeed.initialize(mpu=...)``, rather than the
``parallel_state`` module itself: DeepSpeed asks an mpu for sequence-parallel and
sequence-data-parallel groups, which megatron does not name (without them DeepSpeed would take
``sp = 1`` and shard and reduce over the DP group alone), and for model-parallel sizes and ranks it
has no function for. The methods answer from the ``ProcessGroups`` itself, so a later ``build``
that re-initialises megatron does not change an engine's mpu.

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
import warnings
from datetime import timedelta
from typing import Optional

import torch
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
            raise LayoutError(f"world_size={self.world_size} is not divisible by "
                              f"sp_size={self.sp_size}; world = dp * sp needs sp to divide the "
                              "number of ranks")

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
            raise LayoutError(f"(dp_rank={dp_rank}, sp_rank={sp_rank}) outside dp={self.dp_size} x "
                              f"sp={self.sp_size}")
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


# Megatron-core's import warns, once per module, that Transformer Engine and Apex are missing and
# that its optimizer and Megatron-FSDP code fall back to torch implementations.
_MEGATRON_IMPORT_WARNING = "Transformer Engine and Apex are not installed"


def _parallel_state():
    """``megatron.core.parallel_state``, imported on first use (module doc), quietly and without
    widening torch's ``weights_only`` allowlist."""
    import sys

    first = "megatron.core" not in sys.modules
    before = torch.serialization.get_safe_globals()
    with warnings.catch_warnings():
        # halo_dist uses only parallel_state, never the megatron code those warnings are about
        warnings.filterwarnings("ignore", message=_MEGATRON_IMPORT_WARNING, category=UserWarning)
        from megatron.core import parallel_state
        from megatron.core.safe_globals import SAFE_GLOBALS
    if first:
        # The import adds megatron's types (SimpleNamespace, PosixPath, argparse.Namespace, BytesIO,
        # numpy arrays, its config classes, ...) to torch's weights_only allowlist for the whole
        # process, while safe_load.py promises that checkpoints hold nothing but tensors and the
        # DeepSpeed types: take back what megatron added (types allowed before the import stay
        # allowed).
        added = [g for g in SAFE_GLOBALS if g not in before]
        keep = [g for g in torch.serialization.get_safe_globals() if g not in added]
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(keep)
    return parallel_state


def _default_group_timeout() -> timedelta:
    """The timeout ``dist.new_group(timeout=None)`` gives a group: torch's default for the world's
    backend."""
    from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

    if dist.get_backend() == dist.Backend.NCCL and default_pg_nccl_timeout is not None:
        return default_pg_nccl_timeout
    return default_pg_timeout


@dataclasses.dataclass(frozen=True)
class _MegatronInit:
    """What the last :meth:`ProcessGroups.build` initialised megatron's parallel_state with, and one
    group it got back (to tell its state from one that other code initialised)."""

    world: object  # the default process group at the time
    sp_size: int
    timeout: timedelta
    dp_group: object


_MEGATRON_INIT: Optional[_MegatronInit] = None


def _initialise_megatron(ps, layout: ParallelLayout, timeout: timedelta) -> None:
    """Have megatron's parallel_state hold the groups of ``layout`` (collective unless it already
    does)."""
    global _MEGATRON_INIT
    world = dist.group.WORLD
    if ps.is_initialized():
        last = _MEGATRON_INIT
        if last is None or ps.get_data_parallel_group() is not last.dp_group:
            raise RuntimeError("megatron-core's parallel_state was initialised by other "
                               "code, not ProcessGroups.build; ProcessGroups will "
                               "not replace groups that code may still use. Call "
                               "megatron.core.parallel_state.destroy_model_parallel() first.")
        if last.world is world and last.sp_size == layout.sp_size and last.timeout == timeout:
            return  # same world, layout and timeout: its groups are the ones wanted
        # Another layout, or groups of a world that has been torn down. This only forgets megatron's
        # references: a ProcessGroups built before keeps its groups, and they keep working.
        ps.destroy_model_parallel()
        _MEGATRON_INIT = None
    try:
        # Nothing here needs CUDA or NCCL: groups take the world's backend (gloo on CPU), NCCL
        # options are only built from a communicator config file (none given), and megatron's CUDA
        # barriers belong to SHARP (use_sharp, off).
        ps.initialize_model_parallel(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
            context_parallel_size=layout.sp_size,
            # megatron's default order, pinned: with TP = PP = EP = 1 its CP groups are consecutive
            # ranks
            order="tp-cp-ep-dp-pp",
            # minutes, used only as timedelta(minutes=...): a fraction keeps a timeout given in
            # seconds
            distributed_timeout_minutes=timeout.total_seconds() / 60,
            # no second, gloo copy of the DP groups: they serve megatron's distributed optimizer,
            # which halo_dist does not use (DeepSpeed shards), and on CPU every group is gloo
            # already
            create_gloo_process_groups=False)
    except BaseException:
        ps.destroy_model_parallel()  # no half-built state for the next build to trip over
        raise
    _MEGATRON_INIT = _MegatronInit(world, layout.sp_size, timeout, ps.get_data_parallel_group())


def _megatron_groups(ps, layout: ParallelLayout, rank: int) -> dict:
    """This rank's groups from megatron's parallel_state, their ranks checked against ``layout``."""
    dp_rank, sp_rank = layout.coords(rank)
    groups = {"sp": ps.get_context_parallel_group(), "dp": ps.get_data_parallel_group(),
              # megatron's DP x CP group is a group of its own over all ranks, never WORLD, as
              # DeepSpeed needs: its get_all_ranks_from_group loops until get_global_rank raises,
              # which WORLD never does
              "sdp": ps.get_data_parallel_group(with_context_parallel=True),
              "self": ps.get_model_parallel_group()}  # TP x PP, both of size 1: this rank alone
    expected = {"sp": layout.sp_group_ranks(dp_rank), "dp": layout.dp_group_ranks(sp_rank),
                "sdp": list(range(layout.world_size)), "self": [rank]}
    got = {name: dist.get_process_group_ranks(group) for name, group in groups.items()}
    if got != expected:
        from importlib.metadata import version

        raise RuntimeError(f"megatron-core {version('megatron-core')} built the groups {got} on "
                           f"rank {rank}, but dp={layout.dp_size} x sp={layout.sp_size} needs "
                           f"{expected}: its rank order is not the one this module is written for")
    return groups


class ProcessGroups:
    """The DP / SP / DP x SP process groups, built once by megatron-core; also DeepSpeed's ``mpu``.

    Build with :meth:`build` after ``torch.distributed`` is initialised (every rank must call it,
    in the same order relative to other group creation). Attributes ``layout``, ``rank``,
    ``dp_rank``, ``sp_rank``, ``dp_group``, ``sp_group``, ``sdp_group`` (all ranks, what ZeRO
    shards over) and ``self_group`` (this rank alone; the trivial TP/PP group). The methods answer
    from these attributes and ``layout``, not from megatron's global state, which a later build may
    replace.
    """

    def __init__(self, layout: ParallelLayout, rank: int, dp_group, sp_group, sdp_group,
                 self_group):
        self.layout = layout
        self.rank = rank
        self.dp_rank, self.sp_rank = layout.coords(rank)
        self.dp_group, self.sp_group = dp_group, sp_group
        self.sdp_group, self.self_group = sdp_group, self_group

    @classmethod
    def build(cls, sp_size: int = 1, timeout: Optional[timedelta] = None) -> "ProcessGroups":
        """Validate the layout against the running world, then have megatron-core create the groups
        (collective; module doc). ``timeout``: the groups' collective timeout (None: torch's default
        for a new group of the world's backend)."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call init_process_group "
                               "first")
        layout = ParallelLayout(dist.get_world_size(), sp_size)  # before megatron sees the sizes
        rank = dist.get_rank()
        ps = _parallel_state()
        _initialise_megatron(ps, layout,
                             timeout if timeout is not None else _default_group_timeout())
        groups = _megatron_groups(ps, layout, rank)
        return cls(layout, rank, groups["dp"], groups["sp"], groups["sdp"], groups["self"])

    def __repr__(self):
        return (f"ProcessGroups(world={self.layout.world_size}, dp={self.layout.dp_size}, "
                f"sp={self.layout.sp_size}, rank={self.rank}, dp_rank={self.dp_rank}, "
                f"sp_rank={self.sp_rank})")

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
