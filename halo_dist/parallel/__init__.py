"""Parallel layer: DP x Ulysses-SP process groups (DeepSpeed's mpu), Ulysses all-to-alls, DeepSpeed
start-up. Model code never imports this package; mixers receive a :class:`SequenceParallel` object
by injection (``mixer.apply_sp(SequenceParallel(groups.sp_group))``).

``deepspeed_setup`` is not imported here so that importing this package never imports DeepSpeed
(``DS_ACCELERATOR`` must be set before that happens).
"""

from .apply import (apply_sequence_parallel, apply_sequence_parallel_to_mixers,
                    remove_sequence_parallel)
from .groups import LayoutError, ParallelLayout, ProcessGroups
from .ulysses import (
    SequenceParallel,
    SequenceParallelError,
    head_to_seq,
    kv_replication_factor,
    replicate_kv_heads,
    seq_to_head,
)

__all__ = [
    "LayoutError",
    "ParallelLayout",
    "ProcessGroups",
    "SequenceParallel",
    "SequenceParallelError",
    "apply_sequence_parallel",
    "apply_sequence_parallel_to_mixers",
    "head_to_seq",
    "kv_replication_factor",
    "remove_sequence_parallel",
    "replicate_kv_heads",
    "seq_to_head",
]
