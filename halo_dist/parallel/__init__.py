"""Parallel layer: DP x Ulysses-SP process groups (DeepSpeed's mpu), Ulysses all-to-alls,
DeepSpeed start-up. Model code never imports this package; mixers receive a
:class:`SequenceParallel` object by injection (``mixer.sp = SequenceParallel(groups.sp_group)``).

``deepspeed_setup`` is not imported here so that importing this package never imports DeepSpeed
(``DS_ACCELERATOR`` must be set before that happens).
"""

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
    "head_to_seq",
    "kv_replication_factor",
    "replicate_kv_heads",
    "seq_to_head",
]
