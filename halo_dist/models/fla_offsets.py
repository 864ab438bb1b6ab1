"""fla's varlen state passes without a host sync per call.

fla 0.6.0's ``chunk_fwd_h`` and ``chunk_bwd_dh`` (the state passes behind ``chunk_simple_gla``,
``chunk_gla`` and others) size their state buffer by the number of chunks in a packed batch and read
that number with ``split_offsets[-1].item()``: a host-device synchronisation on every call. A
Lightning layer makes three such calls per micro-batch (the forward, then in the backward the
recomputed forward and the state gradient), so stage 2 of the 2B model made 126 of its 149
synchronisations per step there (``bench/find_syncs.py`` on an H200). Each one drains the GPU's
queue, and the GPU then idles while the host launches the next kernels.

Every layer of one forward, and its backward, passes the same ``cu_seqlens`` tensor. The count is
therefore read once per batch and remembered for that tensor object, as fla remembers the offsets
themselves (``prepare_chunk_offsets`` is cached by argument identity): the entry holds the tensor,
so a later batch in reused memory is a new key. The replacements launch fla's own kernels with fla's
own arguments, so their results are bitwise fla's (``tests/test_fla_offsets.py`` compares them on a
GPU; fla's kernels do not run under Triton's CPU interpreter). They enter through fla's backend
dispatch (``fla.backends.register``), only for the fla version they were written against: any other
version runs fla's functions unchanged. ``HALO_FLA_CACHED_OFFSETS=0`` turns them off.

Installed by the trainer on CUDA (:func:`install`). Not part of an exported model: inference runs
one forward per prompt, where one sync per layer costs little.
"""

from __future__ import annotations

import importlib.metadata

import torch

FLA_VERSION = "0.6.0"  # the version whose kernel arguments the functions below pass
ENV_VAR = "HALO_FLA_CACHED_OFFSETS"
_COUNTS: list[tuple[torch.Tensor, int, int]] = []  # (cu_seqlens, BS, chunks), newest first
_KEEP = 8
_installed = False


def split_count(cu_seqlens: torch.Tensor, split_size: int) -> int:
    """Chunks of ``split_size`` tokens over the packed documents of ``cu_seqlens``: read from the
    device once per tensor (one sync), then remembered."""
    from fla.ops.utils import prepare_chunk_offsets

    for tensor, size, count in _COUNTS:
        if tensor is cu_seqlens and size == split_size:
            return count
    # the last of the offsets the kernels will read (fla caches them by the same identity)
    count = int(prepare_chunk_offsets(cu_seqlens, split_size)[-1].item())
    _COUNTS.insert(0, (cu_seqlens, split_size, count))
    del _COUNTS[_KEEP:]
    return count


def install() -> bool:
    """Register the replacements with fla (once per process). False when fla is missing, is not
    version ``FLA_VERSION``, or ``HALO_FLA_CACHED_OFFSETS=0``."""
    global _installed
    if _installed:
        return True
    try:
        version = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return False
    if version != FLA_VERSION:
        return False
    from fla.backends import register

    register("common")(_backend_class())
    _installed = True
    return True


def _backend_class():
    """The fla backend class (built on first use: fla is imported lazily, CUDA machines only)."""
    from fla.backends import BaseBackend

    class CachedOffsetsBackend(BaseBackend):
        """``chunk_fwd_h`` / ``chunk_bwd_dh`` for packed batches, with the chunk count cached; fla's
        own functions for everything else."""

        backend_type = "halo_cached_offsets"
        env_var = ENV_VAR
        priority = 4  # before fla's optional backends (5): packed batches only, below

        def chunk_fwd_h_verifier(self, *args, **kwargs):
            return _varlen(kwargs)

        def chunk_bwd_dh_verifier(self, *args, **kwargs):
            return _varlen(kwargs)

        def chunk_fwd_h(self, *args, **kwargs):
            return chunk_fwd_h(*args, **kwargs)

        def chunk_bwd_dh(self, *args, **kwargs):
            return chunk_bwd_dh(*args, **kwargs)

    return CachedOffsetsBackend


def _varlen(kwargs: dict) -> tuple[bool, str | None]:
    # fla's callers pass cu_seqlens by keyword (a positional one falls back to fla's function);
    # without cu_seqlens fla itself never syncs
    if kwargs.get("cu_seqlens") is None:
        return False, "fixed-length batch"
    return True, None


def chunk_fwd_h(k, v, g=None, g_gamma=None, gk=None, gv=None, h0=None, output_final_state=False,
                state_v_first=False, cu_seqlens=None, chunk_size=64, split_size=None,
                states_in_fp32=False):
    """fla's ``chunk_fwd_h`` for a packed batch. k ``[1, T, H, K]``, v ``[1, T, H, V]``; returns
    the chunk states h ``[1, NS, H, K, V]`` (``[.., V, K]`` with ``state_v_first``) and the final
    states ``[N, H, K, V]`` fp32 or None."""
    import triton
    from fla.ops.common.chunk_h import chunk_fwd_kernel_h
    from fla.ops.utils import prepare_chunk_offsets

    B, T, H, K, V = *k.shape, v.shape[-1]
    BT = chunk_size
    BS = BT if split_size is None else split_size
    if BS % BT:
        raise ValueError(f"split_size {BS} must be a multiple of chunk_size {BT}")
    split_offsets = prepare_chunk_offsets(cu_seqlens, BS)  # [N + 1] on the device (cached by fla)
    N, NS = len(cu_seqlens) - 1, split_count(cu_seqlens, BS)
    shape = (V, K) if state_v_first else (K, V)
    h = k.new_empty(B, NS, H, *shape, dtype=torch.float if states_in_fp32 else k.dtype)
    ht = k.new_empty(N, H, *shape, dtype=torch.float) if output_final_state else None

    def grid(meta):
        return (triton.cdiv(K, meta["BK"]) * triton.cdiv(V, meta["BV"]) * N * H,)

    chunk_fwd_kernel_h[grid](
        k=k, v=v, h=h, g=g, g_gamma=g_gamma, gk=gk, gv=gv, h0=h0, ht=ht, cu_seqlens=cu_seqlens,
        split_offsets=split_offsets, T=T, H=H, K=K, V=V, BT=BT, BS=BS, USE_G=g is not None,
        USE_G_GAMMA=g_gamma is not None, USE_GK=gk is not None, USE_GV=gv is not None,
        STATE_V_FIRST=state_v_first)
    return h, ht


def chunk_bwd_dh(q, k, v, do, h0, dht, scale, g=None, g_gamma=None, gk=None, gv=None,
                 state_v_first=False, cu_seqlens=None, chunk_size=64, split_size=None,
                 states_in_fp32=False):
    """fla's ``chunk_bwd_dh`` for a packed batch: the chunk state gradients dh ``[1, NS, HQ, K,
    V]`` and the initial state's gradient (None without ``h0``)."""
    import triton
    from fla.ops.common.chunk_h import chunk_bwd_kernel_dh
    from fla.ops.utils import prepare_chunk_offsets

    B, T, H, K, V = *k.shape, v.shape[-1]
    HQ = q.shape[2]
    BT = chunk_size
    BS = BT if split_size is None else split_size
    if BS % BT:
        raise ValueError(f"split_size {BS} must be a multiple of chunk_size {BT}")
    split_offsets = prepare_chunk_offsets(cu_seqlens, BS)
    N, NS = len(cu_seqlens) - 1, split_count(cu_seqlens, BS)
    shape = (V, K) if state_v_first else (K, V)
    dh = k.new_empty(B, NS, HQ, *shape, dtype=torch.float if states_in_fp32 else k.dtype)
    dh0 = torch.empty_like(h0, dtype=torch.float) if h0 is not None else None

    def grid(meta):
        return (triton.cdiv(K, meta["BK"]) * triton.cdiv(V, meta["BV"]) * N * H,)

    chunk_bwd_kernel_dh[grid](
        q=q, g=g, g_gamma=g_gamma, gk=gk, gv=gv, do=do, dh=dh, dht=dht, dh0=dh0,
        cu_seqlens=cu_seqlens, split_offsets=split_offsets, scale=scale, T=T, HQ=HQ, H=H, K=K,
        V=V, BT=BT, BS=BS, NG=HQ // H, USE_G=g is not None, USE_G_GAMMA=g_gamma is not None,
        USE_GK=gk is not None, USE_GV=gv is not None, STATE_V_FIRST=state_v_first)
    return dh, dh0
