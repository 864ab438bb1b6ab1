"""How ``StaticDecoder`` runs a decode step: one typed, validated set of options.

The defaults are the fast path measured on H100 and H200 (BENCHMARKS.md): packed input projections,
Lightning's state updated in place by one fused kernel per layer, the batch-1 GEMV where it beats
cuBLAS, a CUDA graph on CUDA. The other values exist for users who need them (a compiled step, a
narrower or lazily written RNN state for rollout batches) and for the decode profiler, which
compares them (``bench/profile_decode.py --variants``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .lightning_state import STATE_DTYPES

# torch.compile modes for the step: Inductor's own CUDA-graph modes are left out, because the
# decoder captures its own graph
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class DecodeOptions:
    """``use_cuda_graph``: capture the step as a CUDA graph (None: on CUDA). ``warmup_steps``: eager
    steps before the capture (Triton compiles and autotunes there). ``compile``: fuse the step with
    ``torch.compile`` first (a string is the compile mode, ``COMPILE_MODES``; a compiler failure
    falls back to the eager step). ``pack_projections``: each layer's input projections as one GEMM.
    ``lightning_in_place``: Lightning's state updated in place by our kernel (False: fla's kernel,
    then a copy). ``fuse_lightning``: that kernel also does the layer's QK-norm, RoPE, output norm
    and gate on CUDA. ``gemv``: the packed projections and output linears through the batch-1 GEMV
    kernel for the weight shapes where it timed faster than cuBLAS (None: for one-row decoders on
    CUDA). ``state_dtype``: the RNN states' dtype (None: fp32; ``STATE_DTYPES``), and
    ``state_write_every``: states written back every n tokens; both for Lightning-only models."""

    use_cuda_graph: bool | None = None
    warmup_steps: int = 2
    compile: bool | str = False
    pack_projections: bool = True
    lightning_in_place: bool = True
    fuse_lightning: bool = True
    gemv: bool | None = None
    state_dtype: torch.dtype | None = None
    state_write_every: int = 1

    def __post_init__(self):
        if isinstance(self.compile, str) and self.compile not in COMPILE_MODES:
            raise ValueError(f"DecodeOptions(compile={self.compile!r}): the modes are "
                             f"{sorted(COMPILE_MODES)} (the decoder captures its own CUDA graph)")
        if self.warmup_steps < 0:
            raise ValueError(f"DecodeOptions(warmup_steps={self.warmup_steps}): must be >= 0")
        if self.state_dtype is not None and self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"DecodeOptions(state_dtype={self.state_dtype}): one of "
                             f"{STATE_DTYPES} (or None: fp32)")
        if self.state_write_every < 1:
            raise ValueError(f"DecodeOptions(state_write_every={self.state_write_every}): "
                             f"must be >= 1")

    def replace(self, **changes) -> DecodeOptions:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)
