"""Peak live tensor memory on any device (CPU included), for tests and the CPU bench smoke mode.

``torch.cuda.max_memory_allocated`` has no CPU counterpart, so this counts, at the aten dispatch
level, the bytes of every tensor storage created inside the block and still alive after each op.
Kernel-internal workspaces (e.g. inside ``logsumexp``) are invisible to it: use it to compare how
memory *scales* between implementations, and CUDA's allocator statistics for absolute peaks.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes(inputs) as m: ...`` -> ``m.peak`` (bytes alive at once, storages created in
    the block), ``m.biggest`` (bytes of the largest single storage). ``preexisting`` tensors'
    storages (the inputs) are never counted, even when an op returns a view of them."""

    def __init__(self, preexisting=()):
        super().__init__()
        self.skip = {t.untyped_storage().data_ptr() for t in preexisting}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = self.biggest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Drop freed storages first: the allocator may hand a freed address to a new tensor.
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st.data_ptr() not in self.skip and st.data_ptr() not in self.live:
                    self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
                    self.biggest = max(self.biggest, st.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out
