"""The packed, resumable, DP/SP/worker-aware loader.

Global layout (identical on every process): epoch ``e``'s token stream (:mod:`.stream`) is cut into
rows of L tokens, ``R = epoch_tokens // L`` rows. Micro-batches are runs of B consecutive rows;
in a step every DP rank takes one: with ``P`` rows consumed at the start of the epoch (0, or the
resume point), rank r's batch b holds rows ``P + (b*dp + r)*B ... + B-1``. Every rank therefore has
exactly ``(R - P) // (dp*B)`` batches per epoch (count-based, so collectives never hang), and the
remaining rows (< dp*B) and tokens (< L) of an epoch are dropped. Worker w of W takes this rank's
batches j ≡ w (mod W); torch's DataLoader returns them round-robin, i.e. in the same order as W=0.

State = (epoch, rows consumed in the epoch). Since it is a position in the global row sequence, a
restore under another dp_size or micro-batch size continues that exact sequence with nothing
skipped or repeated; a different seq_len, seed, shuffle setting or data set is refused.
"""
from __future__ import annotations

import logging
from typing import Iterator

import torch

from .errors import DataError
from .packing import pack_batch, sp_slice
from .stream import TokenStream

log = logging.getLogger(__name__)
STATE_VERSION = 1


class _Plan:
    """Picklable batch schedule + batch maker shared by the main process and workers."""

    def __init__(self, stream: TokenStream, seq_len: int, batch: int, dp_rank: int, dp_size: int,
                 sp_rank: int, sp_size: int, max_epochs: int | None):
        self.stream, self.L, self.B = stream, seq_len, batch
        self.dp_rank, self.dp_size, self.sp_rank, self.sp_size = dp_rank, dp_size, sp_rank, sp_size
        self.max_epochs = max_epochs
        self.rows_per_epoch = stream.epoch_tokens // seq_len

    def schedule(self, epoch: int, rows: int) -> Iterator[tuple[int, int, int]]:
        """Yield (epoch, first row of this rank's batch, rows consumed after the step) from a
        position."""
        step = self.dp_size * self.B
        while self.max_epochs is None or epoch < self.max_epochs:
            for b in range((self.rows_per_epoch - rows) // step):
                yield (epoch, rows + (b * self.dp_size + self.dp_rank) * self.B,
                       rows + (b + 1) * step)
            epoch, rows = epoch + 1, 0

    def make(self, epoch: int, row0: int) -> dict:
        """The micro-batch of rows [row0, row0+B) of ``epoch`` as torch tensors (SP-sliced)."""
        a = row0 * self.L
        tokens, starts = self.stream.fetch(epoch, a, a + self.B * self.L)  # [B*L], [k]
        out = pack_batch(tokens, starts, self.B, self.L)
        if self.sp_size > 1:
            out = sp_slice(out, self.sp_rank, self.sp_size)
        for k in ("input_ids", "position_ids", "labels", "cu_seqlens"):
            out[k] = torch.from_numpy(out[k])
        return out


class _WorkerStream(torch.utils.data.IterableDataset):
    """What each DataLoader worker runs: its share (j ≡ w mod W) of the rank's batches."""

    def __init__(self, plan: _Plan, epoch: int, rows: int):
        super().__init__()
        self.plan, self.epoch, self.rows = plan, epoch, rows

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for j, (epoch, row0, _) in enumerate(self.plan.schedule(self.epoch, self.rows)):
            if j % nw == wid:
                yield self.plan.make(epoch, row0)


class PackedLoader:
    """Iterable of packed micro-batches with exact ``state_dict``/``load_state_dict`` resume.

    Iterating continues from the current position (breaking out and iterating again does not
    restart); with ``max_epochs=None`` it never ends. Each batch is a dict:
    input_ids/position_ids/labels LongTensor [B, L] (or [B, L/sp] with SP), cu_seqlens IntTensor
    [S+1] and max_seqlen int of the full rows, plus sp_rank/sp_size ints when sp_size > 1.
    """

    def __init__(self, stream: TokenStream, seq_len: int, micro_batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1, sp_rank: int = 0, sp_size: int = 1, num_workers: int = 0,
                 max_epochs: int | None = None, prefetch_factor: int = 4, pin_memory: bool = False,
                 fingerprint: str = "", skipped_shards: list | None = None):
        _check_layout(seq_len, micro_batch_size, dp_rank, dp_size, sp_rank, sp_size)
        self.plan = _Plan(stream, seq_len, micro_batch_size, dp_rank, dp_size, sp_rank, sp_size,
                          max_epochs)
        if self.plan.rows_per_epoch < dp_size * micro_batch_size:
            raise DataError(f"data set too small: {stream.epoch_tokens} tokens give "
                            f"{self.plan.rows_per_epoch} rows of {seq_len}, one step needs "
                            f"dp_size*micro_batch_size = {dp_size * micro_batch_size}")
        self.num_workers, self.prefetch_factor, self.pin_memory = (num_workers, prefetch_factor,
                                                                   pin_memory)
        self.fingerprint, self.skipped_shards = fingerprint, list(skipped_shards or [])
        self.epoch, self.rows_consumed, self.batches_yielded = 0, 0, 0

    @property
    def stream(self) -> TokenStream:
        return self.plan.stream

    @property
    def seq_len(self) -> int:
        return self.plan.L

    @property
    def micro_batch_size(self) -> int:
        return self.plan.B

    def __len__(self) -> int:
        """Batches per full epoch on every rank."""
        return self.plan.rows_per_epoch // (self.plan.dp_size * self.plan.B)

    def __iter__(self) -> Iterator[dict]:
        sched = self.plan.schedule(self.epoch, self.rows_consumed)
        source = _WorkerStream(self.plan, self.epoch, self.rows_consumed)
        if self.num_workers > 0:
            source = torch.utils.data.DataLoader(
                source, batch_size=None, num_workers=self.num_workers,
                prefetch_factor=self.prefetch_factor, pin_memory=self.pin_memory)
        for (epoch, _, after), batch in zip(sched, source):
            self.epoch, self.rows_consumed = epoch, after
            self.batches_yielded += 1
            yield batch

    def state_dict(self) -> dict:
        """Position (identical on every rank) plus what must match on restore."""
        p = self.plan
        return {"version": STATE_VERSION, "epoch": self.epoch, "rows_consumed": self.rows_consumed,
                "batches_yielded": self.batches_yielded, "seq_len": p.L, "micro_batch_size": p.B,
                "dp_size": p.dp_size, "seed": p.stream.seed, "shuffle": p.stream.shuffle,
                "shuffle_window": p.stream.window, "fingerprint": self.fingerprint,
                "rows_per_epoch": p.rows_per_epoch}

    def load_state_dict(self, state: dict) -> None:
        """Restore a position; refuses (DataError saying why) states that cannot resume exactly."""
        p = self.plan
        if state.get("version") != STATE_VERSION:
            raise DataError(f"loader state version {state.get('version')} unsupported (need "
                            f"{STATE_VERSION})", key="version")
        mine = {"seq_len": p.L, "seed": p.stream.seed, "shuffle": p.stream.shuffle,
                "shuffle_window": p.stream.window, "fingerprint": self.fingerprint}
        for key, val in mine.items():
            if state.get(key) != val:
                why = ("the data set (shards, counts or checksums) changed" if key == "fingerprint"
                       else "the token stream would differ")
                raise DataError(f"cannot resume exactly: saved {key}={state.get(key)!r}, now "
                                f"{val!r}; {why}", key=key)
        rows = int(state["rows_consumed"])
        if not 0 <= rows <= p.rows_per_epoch:
            raise DataError(f"saved rows_consumed={rows} outside an epoch of {p.rows_per_epoch} "
                            "rows", key="rows_consumed")
        if (state.get("dp_size"), state.get("micro_batch_size")) != (p.dp_size, p.B):
            log.info("loader: state saved with dp_size=%s micro_batch=%s, resumed with dp_size=%s "
                     "micro_batch=%s; continuing the same global row sequence at epoch %s row %s",
                     state.get("dp_size"), state.get("micro_batch_size"), p.dp_size, p.B,
                     state["epoch"], rows)
        self.epoch, self.rows_consumed = int(state["epoch"]), rows
        self.batches_yielded = int(state.get("batches_yielded", 0))

    def close(self) -> None:
        self.plan.stream.close()


def _check_layout(seq_len, batch, dp_rank, dp_size, sp_rank, sp_size) -> None:
    if seq_len < 2 or batch < 1:
        raise ValueError(f"need seq_len >= 2 and micro_batch_size >= 1, got {seq_len}, {batch}")
    if not (dp_size >= 1 and 0 <= dp_rank < dp_size):
        raise ValueError(f"dp_rank {dp_rank} outside dp_size {dp_size}")
    if not (sp_size >= 1 and 0 <= sp_rank < sp_size):
        raise ValueError(f"sp_rank {sp_rank} outside sp_size {sp_size}")
    if seq_len % sp_size:
        raise ValueError(f"seq_len {seq_len} is not divisible by sp_size {sp_size}: each "
                         "sequence-parallel rank needs an equal contiguous slice")
