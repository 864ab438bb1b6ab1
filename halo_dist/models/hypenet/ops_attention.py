"""Softmax-attention kernels behind HypeNet's attention mixers, dispatched by device: packed
(document-masked, optionally windowed) causal attention through flash-attn varlen, FlexAttention or
SDPA with a mask; SDPA with GQA; chunked-prefill attention over a cache.

Exported with every checkpoint: torch only (flash-attn optional).
Layout everywhere: q ``[B, T, Hq, D]``, k/v ``[B, T, Hkv, D]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # flash-attn is an optional extra (no binary wheel for every platform; SDPA is the fallback)
    from flash_attn import flash_attn_varlen_func

    _HAS_FLASH_ATTN = True
except Exception:  # pragma: no cover
    _HAS_FLASH_ATTN = False


def segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """int ``[N+1]`` boundaries -> ``[total]`` segment index of every token."""
    marks = torch.zeros(total + 1, dtype=torch.int32, device=cu_seqlens.device)
    marks.index_add_(0, cu_seqlens[1:-1].long(),
                     torch.ones_like(cu_seqlens[1:-1], dtype=torch.int32))
    return marks[:total].cumsum(0)


def local_causal_mask(Tq: int, Tk: int, window: int | None, device) -> torch.Tensor:
    """``[Tq, Tk]`` bool: the Tq queries are the last Tq of the Tk keys; query i sees key j iff
    j <= i and (window is None or i - j < window) (a window of W keeps W keys, itself included)."""
    qi = torch.arange(Tk - Tq, Tk, device=device)[:, None]
    kj = torch.arange(Tk, device=device)[None, :]
    mask = kj <= qi
    if window is not None:
        mask = mask & (qi - kj < window)
    return mask


def packed_causal_attention(q, k, v, cu_seqlens, max_seqlen, scale, window: int | None = None):
    """Causal attention that never crosses a document boundary, optionally within a sliding window.

    q ``[B, T, Hq, D]``, k/v ``[B, T, Hkv, D]`` with ``cu_seqlens`` over the flattened B*T tokens;
    ``window`` W: each query sees itself and the W - 1 previous tokens of its document.
    flash-attn varlen on CUDA when installed; otherwise SDPA with a block-diagonal causal mask.
    Returns ``[B, T, Hq, D]``.
    """
    B, T, Hq, D = q.shape
    if (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and not _HAS_FLASH_ATTN
            and _flex_usable()):
        o = _flex_document_attention(q, k, v, cu_seqlens, scale, window)
        if o is not None:
            return o
    if _HAS_FLASH_ATTN and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        cu = cu_seqlens.to(torch.int32)
        # [B, T, H, D] -> [B*T, H, D]: flash-attn's varlen layout
        o = flash_attn_varlen_func(
            q.reshape(B * T, Hq, D), k.reshape(B * T, -1, D), v.reshape(B * T, -1, D),
            cu, cu, max_seqlen, max_seqlen, softmax_scale=scale, causal=True,
            window_size=(-1, -1) if window is None else (window - 1, 0),
        )
        return o.view(B, T, Hq, D)
    seg = segment_ids_from_cu_seqlens(cu_seqlens, B * T).view(B, T)
    same_doc = seg[:, :, None] == seg[:, None, :]  # [B, T, T]
    mask = (same_doc & local_causal_mask(T, T, window, q.device))[:, None]  # [B, 1, T, T]
    return sdpa(q, k, v, mask=mask, scale=scale)


def rows_cu_seqlens(batch: int, seq_len: int, device) -> torch.Tensor:
    """int32 ``[B+1]`` boundaries of B unpacked rows of T tokens (each row one document)."""
    return torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=device)


def sdpa(q, k, v, mask=None, is_causal=False, scale=None):
    """torch SDPA on ``[B, T, H, D]`` tensors with GQA. On CUDA without a mask, ``enable_gqa`` lets
    the flash kernel read the shared k/v heads in place; otherwise k/v heads are repeated to the
    query heads."""
    Hq, Hkv = q.shape[2], k.shape[2]
    if Hq != Hkv and mask is None and q.is_cuda:
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [B, H, T, D]
            is_causal=is_causal, scale=scale, enable_gqa=True,
        )
        return o.transpose(1, 2)  # [B, H, T, D] -> [B, T, H, D]
    if Hq != Hkv:
        k = k.repeat_interleave(Hq // Hkv, dim=2)  # [B, Tk, Hkv, D] -> [B, Tk, Hq, D]
        v = v.repeat_interleave(Hq // Hkv, dim=2)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [B, H, T, D]
        attn_mask=mask, is_causal=is_causal and mask is None, scale=scale,
    )
    return o.transpose(1, 2)  # [B, H, T, D] -> [B, T, H, D]


# ---- FlexAttention: packed (document-masked) causal attention on CUDA without flash-attn ---------
# SDPA with an explicit [T, T] mask cannot use its flash kernel; FlexAttention compiles a
# block-sparse kernel that skips blocks across documents, above the diagonal and outside the window.
# The block mask depends only on cu_seqlens (and the window), which every layer of one forward (and
# its recomputation) shares, so the last few are kept.
_FLEX: dict = {"fn": None, "failed": False, "masks": []}


def _flex_usable() -> bool:
    if _FLEX["failed"]:
        return False
    if _FLEX["fn"] is None:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            # default dynamic=None: static for the first shape, then one dynamic-shape recompile
            # (OPD batches change length every step; dynamic=False would recompile per length up to
            # the limit)
            _FLEX["fn"] = torch.compile(flex_attention)
        except Exception:  # pragma: no cover - old torch
            _FLEX["failed"] = True
            return False
    return True


def document_block_mask(cu_seqlens: torch.Tensor, B: int, T: int, window: int | None,
                        block_size: int = 128):
    """FlexAttention ``BlockMask`` of document-causal (optionally windowed) attention over
    ``[B, T]`` packed rows, built from the document boundaries alone in O((T / block_size)^2)
    memory.

    ``create_block_mask`` evaluates the mask on a dense ``[T, T]`` grid first: 64 GiB at 256K
    tokens. Here the block structure is computed directly. A query block ``[q_lo, q_hi]`` attends
    keys ``[lb(q_lo), q_hi]`` (the union of its queries' ranges, contiguous because the lower bound
    ``lb(q) = max(doc_start(q), q - W + 1)`` never decreases). A block is *full* (no mask needed)
    when its keys all precede its queries, query and key ends share a document (document ids never
    decrease within a row) and the window covers the farthest pair; every other visited block is
    *partial* and runs ``mask_mod``. Blocks cut by the sequence end are kept partial."""
    from torch.nn.attention.flex_attention import BlockMask

    dev = cu_seqlens.device
    seg = segment_ids_from_cu_seqlens(cu_seqlens, B * T).view(B, T)  # [B, T] document id per token
    pos = torch.arange(T, device=dev)
    is_start = torch.ones(B, T, dtype=torch.bool, device=dev)
    is_start[:, 1:] = seg[:, 1:] != seg[:, :-1]
    # [B, T] first position of each token's document
    doc_start = torch.where(is_start, pos, 0).cummax(dim=1).values
    # [B, T] first visible key
    lower = doc_start if window is None else torch.maximum(doc_start, pos - window + 1)

    n = -(-T // block_size)
    starts = torch.arange(n, device=dev) * block_size  # [n] first token of each block
    ends = torch.clamp(starts + block_size - 1, max=T - 1)  # [n] last token of each block
    # [n, 1], [1, n] block indices
    qi, kj = starts[:, None] // block_size, starts[None, :] // block_size
    # [B, n] first key block each query block visits
    first_kv_block = lower[:, starts] // block_size
    visited = (kj <= qi) & (kj >= first_kv_block[:, :, None])  # [B, n, n]
    same_doc = seg[:, ends][:, :, None] == seg[:, starts][:, None, :]  # [B, n, n]
    full = (ends[None, :] < starts[:, None]) & same_doc
    if window is not None:
        full = full & (ends[:, None] - starts[None, :] < window)
    if T % block_size:
        cut = torch.zeros(n, dtype=torch.bool, device=dev)
        cut[-1] = True  # the last block is shorter than block_size: let mask_mod handle it
        full = full & ~cut[:, None] & ~cut[None, :]
    full = full & visited
    partial = visited & ~full

    def doc_causal(b, h, q_idx, kv_idx):
        keep = (q_idx >= kv_idx) & (seg[b, q_idx] == seg[b, kv_idx])
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        return keep

    kv_num, kv_idx = _blocks_in_order(partial)
    full_num, full_idx = _blocks_in_order(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=doc_causal, seq_lengths=(T, T))


def _blocks_in_order(blocks: torch.Tensor):
    """``[B, n, n]`` bool -> counts ``[B, 1, n]``, indices ``[B, 1, n, n]`` (true ones first)."""
    counts = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[:, None], order[:, None]


def _document_block_mask(cu_seqlens: torch.Tensor, B: int, T: int, window: int | None):
    # An entry holds the cu_seqlens tensor itself, so its memory cannot be reused by another batch's
    # boundaries while cached: identity + version + shape + window identify the content.
    for entry in _FLEX["masks"]:
        if (entry[0] is cu_seqlens and entry[1:4] == (cu_seqlens._version, B, T)
                and entry[4] == window):
            return entry[5]
    mask = document_block_mask(cu_seqlens, B, T, window)
    _FLEX["masks"] = [(cu_seqlens, cu_seqlens._version, B, T, window, mask)] + _FLEX["masks"][:1]
    return mask


def _flex_document_attention(q, k, v, cu_seqlens, scale, window: int | None = None):
    """q ``[B, T, Hq, D]``, k/v ``[B, T, Hkv, D]`` -> ``[B, T, Hq, D]``; GQA without copying k/v."""
    B, T, Hq, _ = q.shape
    try:
        mask = _document_block_mask(cu_seqlens, B, T, window)
        o = _FLEX["fn"](q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [B, H, T, D]
                        block_mask=mask, scale=scale, enable_gqa=Hq != k.shape[2])
    except Exception as err:  # pragma: no cover
        # compiler trouble: the dense-mask SDPA path still works
        import warnings

        warnings.warn(f"FlexAttention failed ({type(err).__name__}: {err}); using SDPA with a "
                      "dense mask")
        _FLEX["failed"] = True
        return None
    return o.transpose(1, 2)  # [B, H, T, D] -> [B, T, H, D]


def chunk_prefill_attention(q, k, v, scale):
    """Causal attention of ``Tq`` new queries over ``Tk >= Tq`` keys whose last ``Tq`` are the
    queries' own (chunked prefill): query i sees keys ``<= Tk - Tq + i``. q ``[B, Tq, H, D]`` ->
    ``[B, Tq, H, D]``.
    CUDA: SDPA's lower-right causal bias (flash kernel, no [Tq, Tk] mask); elsewhere an explicit
    mask."""
    Tq, Tk = q.shape[1], k.shape[1]
    if q.is_cuda:
        from torch.nn.attention.bias import causal_lower_right

        Hq, Hkv = q.shape[2], k.shape[2]
        if Hq != Hkv:
            k = k.repeat_interleave(Hq // Hkv, dim=2)  # [B, Tk, Hkv, D] -> [B, Tk, Hq, D]
            v = v.repeat_interleave(Hq // Hkv, dim=2)
        # [B, H, T, D]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=causal_lower_right(Tq, Tk), scale=scale)
        return o.transpose(1, 2)  # [B, H, Tq, D] -> [B, Tq, H, D]
    causal = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
    return sdpa(q, k, v, mask=causal[None, None], scale=scale)
