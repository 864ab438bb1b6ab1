"""Held-out evaluation during training: fixed rows, summed over every rank, logged as ``eval/``
scalars.

The rows are built once (the first ``eval.rows`` rows of the held-out split, unshuffled, split over
DP ranks and SP columns exactly like training batches) and kept on the host, so every evaluation
of a run, resumed or not, scores the same tokens. The batches go through the DeepSpeed engine's
forward with ``evaluate=True``: under ZeRO-3 that is what gathers the partitioned weights. The stage
module answers with ``{name: (sum, count)}``; sums and counts are all-reduced over the whole world
(DP ranks hold disjoint rows and SP ranks disjoint columns, so every token counts once) and logged
as ``eval/<name> = sum / count``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..data import build_loader, resolve_shards
from ..data.errors import DataError


class HeldoutEval:
    """``run(engine, step)`` evaluates the fixed held-out batches and returns
    ``{eval/<name>: mean}``."""

    def __init__(self, batches: list[dict], device: torch.device):
        self.batches, self.device = batches, device

    @classmethod
    def check_config(cls, cfg) -> None:
        """Fail before anything is allocated when the evaluated split does not exist."""
        if not cfg.eval.every_steps:
            return
        source = cfg.data.eval or cfg.data.train
        try:
            resolve_shards(source, cfg.eval.split)
        except (DataError, FileNotFoundError, KeyError) as e:
            raise DataError(f"eval.every_steps={cfg.eval.every_steps} evaluates the "
                            f"'{cfg.eval.split}' split of {source}, which cannot be read ({e}); "
                            "set data.eval to held-out shards or eval.every_steps=0") from None

    @classmethod
    def from_trainer(cls, trainer) -> "HeldoutEval | None":
        cfg = trainer.cfg
        if not cfg.eval.every_steps:
            return None
        micro, dp = trainer.layout.micro_batch_size, trainer.layout.dp_size
        per_rank = max(1, cfg.eval.rows // (micro * dp))  # whole micro-batches on every rank
        loader = build_loader(cfg.data.eval or cfg.data.train, cfg.data.seq_len, micro,
                              trainer.groups.dp_rank, dp, trainer.groups.sp_rank,
                              cfg.parallel.sp_size, seed=0, split=cfg.eval.split,
                              shuffle=False, max_epochs=1, verify="size")
        batches = []
        for batch in loader:
            batches.append(batch)
            if len(batches) == per_rank:
                break
        if not batches:
            raise DataError(f"the '{cfg.eval.split}' split of "
                            f"{cfg.data.eval or cfg.data.train} holds fewer than "
                            f"{micro * dp} rows of {cfg.data.seq_len} tokens: nothing to evaluate")
        if trainer.rank == 0 and len(batches) < per_rank:
            print(f"eval: the held-out split holds only {len(batches) * micro * dp} rows of "
                  f"{cfg.data.seq_len} tokens (eval.rows={cfg.eval.rows})", flush=True)
        return cls(batches, trainer.device)

    @property
    def rows(self) -> int:
        return sum(int(b["input_ids"].shape[0]) for b in self.batches)

    def run(self, engine) -> dict[str, float]:
        """Evaluate every batch (no gradients, eval mode), reduce over the world, return the
        means."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        was_training = engine.training
        engine.eval()
        try:
            with torch.no_grad():
                for batch in self.batches:
                    batch = {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v
                             for k, v in batch.items()}
                    for name, (total, count) in engine(**batch, evaluate=True).items():
                        acc_sum, acc_count = sums.get(name, (zero, zero))
                        sums[name] = (acc_sum + total.double(), acc_count + float(count))
        finally:
            engine.train(was_training)
        names = sorted(sums)
        # [2 * metrics]: (sum, count) pairs
        packed = torch.stack([v for n in names for v in sums[n]])
        dist.all_reduce(packed)
        return {f"eval/{n}": float(packed[2 * i] / packed[2 * i + 1].clamp_min(1))
                for i, n in enumerate(names)}
