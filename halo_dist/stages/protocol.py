"""What a stage is to the trainer: the module it trains (:class:`StageModule`) and how the stage is
built, written and run (:class:`StageSpec`). The table of stages is ``halo_dist.registry``.

The trainer calls only what :class:`StageModule` declares (plus ``enable_zero3`` where a module has
one), so a new stage is a module with these methods, a build function and an output writer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Union, runtime_checkable

import torch
from torch import nn

from ..config import RunConfig

TrainOutput = tuple[torch.Tensor, torch.Tensor, int]
"""``(loss for backward, detached token-sum of the tracked objective, token count)``."""

EvalOutput = dict[str, tuple[torch.Tensor, int]]
"""``{name: (detached sum, count)}`` of the held-out figures (train/evaluation.py)."""


@runtime_checkable
class StageModule(Protocol):
    """The trainable module of a stage, as the Trainer uses it."""

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 *, normalizer: float = 1.0, evaluate: bool = False,
                 **batch: Any) -> Union[TrainOutput, EvalOutput]:
        """The forward: the loss divided by ``normalizer`` with its tracked sum and token count, or
        with ``evaluate`` the held-out sums."""

    def loss_tokens(self, batch: dict) -> int:
        """Tokens of ``batch`` the loss averages over (the global count normalises every
        micro-batch)."""

    @property
    def student_config(self) -> Any:
        """The config of the student this stage trains (recorded in checkpoints, exported)."""

    def sp_mixers(self) -> list[nn.Module]:
        """The trained token mixers, in layer order, that sequence parallelism is injected into."""


Build = Callable[[RunConfig], tuple[StageModule, Optional[nn.Module]]]
"""``build(cfg) -> (trainable module, frozen teacher or None)``, on the CPU in float32."""

WriteOutput = Callable[[Any, Path], Optional[Path]]
"""``write_output(trainer, folder) -> path`` of what the stage leaves (rank 0; None elsewhere); all
ranks call it (ZeRO-3 gathers are collective)."""


@dataclass(frozen=True)
class StageSpec:
    """One row of the stage table: how the stage builds, what it writes and which trainer runs it.

    ``build`` / ``write_output`` are None for a trainer that builds its models in ``setup`` and
    writes its export in ``finish`` itself (OPD: rollouts need the tokenizer, and under ZeRO-3 a
    gathered replica of the student).
    ``trainer_cls``: a ``halo_dist.train`` Trainer class, constructed as
    ``trainer_cls(cfg, argv, stage=spec)`` (typed loosely: stages sit below train and do not import
    it)."""

    name: str
    build: Optional[Build]
    write_output: Optional[WriteOutput]
    trainer_cls: type
