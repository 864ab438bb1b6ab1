"""Packing a contiguous token range into a micro-batch with document boundaries, and SP slicing.

Pure numpy; the loader converts the result to torch tensors.
"""
from __future__ import annotations

import numpy as np

IGNORE_INDEX = -100


def pack_batch(tokens: np.ndarray, sample_starts: np.ndarray, batch: int, seq_len: int) -> dict:
    """Cut a flat token range into ``batch`` rows of ``seq_len`` with segment metadata.

    Args:
        tokens: [B*L] integer tokens, documents (with their EOS) back to back.
        sample_starts: sorted offsets in [0, B*L) where a sample (document or piece) starts.
        batch: B. seq_len: L.
    Returns (numpy):
        input_ids [B, L] int64; position_ids [B, L] int64 restarting at 0 at every segment;
        labels [B, L] int64, the next token of the same segment or -100;
        cu_seqlens [S+1] int32 over the flattened B*L tokens (row starts are boundaries);
        max_seqlen int.
    """
    n = batch * seq_len
    if tokens.shape != (n,):
        raise ValueError(f"expected {n} tokens, got {tokens.shape}")
    row_starts = np.arange(0, n, seq_len, dtype=np.int64)
    # [S] sorted segment starts
    starts = np.union1d(np.asarray(sample_starts, np.int64), row_starts)
    bounds = np.append(starts, n)  # [S+1]
    seg_len = np.diff(bounds)  # [S]
    ids = tokens.astype(np.int64)  # [B*L]
    pos = np.arange(n, dtype=np.int64) - np.repeat(starts, seg_len)  # [B*L]
    labels = np.empty(n, np.int64)  # [B*L]
    labels[:-1] = ids[1:]
    labels[bounds[1:] - 1] = IGNORE_INDEX  # last token of every segment has no in-segment successor
    return {"input_ids": ids.reshape(batch, seq_len),  # [B*L] -> [B, L]
            "position_ids": pos.reshape(batch, seq_len),
            "labels": labels.reshape(batch, seq_len),
            "cu_seqlens": bounds.astype(np.int32),
            "max_seqlen": int(seg_len.max())}


def sp_slice(batch: dict, sp_rank: int, sp_size: int) -> dict:
    """Keep SP rank ``sp_rank``'s contiguous column slice [r*L/sp, (r+1)*L/sp) of the per-token
    tensors.

    ``cu_seqlens``/``max_seqlen`` stay those of the full sequence (the head-parallel kernels see
    the full sequence after the all-to-all); labels were computed on the full rows before slicing.
    """
    seq_len = batch["input_ids"].shape[1]
    if seq_len % sp_size:
        raise ValueError(f"seq_len {seq_len} is not divisible by sp_size {sp_size}")
    part = seq_len // sp_size
    cols = slice(sp_rank * part, (sp_rank + 1) * part)
    out = dict(batch)
    for k in ("input_ids", "position_ids", "labels"):
        out[k] = batch[k][:, cols]  # [B, L] -> [B, L/sp]
    out["sp_rank"], out["sp_size"] = sp_rank, sp_size
    return out
