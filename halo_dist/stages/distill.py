"""The student and its loss in one module: HALO stages 2 and 3 (forward KL(teacher ‖ student) over
the full vocabulary) and stage pretrain (cross-entropy, no teacher).

The loss is fused and chunked (``halo_dist.losses``): neither model's ``[tokens × vocab]`` logits
exist at once. The student returns final hidden states only; the vocabulary projection happens
inside the loss with the (ZeRO-3-gathered) lm_head. Stage 3's ``ce`` objective skips the teacher;
``loss.kl_max_position`` keeps KL inside the teacher's trained context and trains CE beyond it.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..losses import fused_distill_loss
from ..models.hypenet import HypeNetForCausalLM


class StudentWithLoss(nn.Module):
    """Student + loss in one module, so DeepSpeed sees one forward (and ZeRO-3 gathers the lm_head).
    A :class:`~halo_dist.stages.protocol.StageModule` of stages 2, 3 and pretrain."""

    def __init__(self, student: HypeNetForCausalLM, teacher: HypeNetForCausalLM | None,
                 objective: str = "kl", temperature: float = 1.0, ce_weight: float = 0.0,
                 chunk_size: int | None = None, direction: str = "forward",
                 kl_max_position: int | None = None, backend: str = "auto"):
        super().__init__()
        self.student = student
        self._teacher = [teacher]  # frozen and never saved: not a submodule
        self.objective, self.temperature, self.ce_weight = objective, temperature, ce_weight
        self.chunk_size, self.direction, self.kl_max_position = (chunk_size, direction,
                                                                 kl_max_position)
        self.backend = backend  # of the fused loss while training (evaluation keeps the default)
        self._zero3 = False

    @property
    def teacher(self):
        return self._teacher[0]

    @property
    def student_config(self):
        return self.student.config

    def sp_mixers(self) -> list[nn.Module]:
        """Every decoder layer's mixer, in layer order."""
        return [layer.mixer for layer in self.student.model.layers]

    def loss_tokens(self, batch: dict) -> int:
        """Tokens the loss averages over: the labelled ones for CE; with ``kl_max_position`` the KL
        tokens before it and the labelled ones from it on; else (KL) every token."""
        if self.objective == "ce":
            return int((batch["labels"] != -100).sum())
        if self.kl_max_position:
            inside = batch["position_ids"] < self.kl_max_position
            return int(inside.sum() + ((batch["labels"] != -100) & ~inside).sum())
        return int(batch["input_ids"].numel())

    def enable_zero3(self) -> None:
        """The loss reads ``lm_head.weight`` outside lm_head's own forward: tell ZeRO-3 to gather
        it."""
        import deepspeed

        deepspeed.zero.register_external_parameter(self, self.student.lm_head.weight)
        self._zero3 = True

    def forward(self, input_ids, position_ids, cu_seqlens=None, max_seqlen=None, labels=None,
                normalizer: float = 1.0, evaluate: bool = False, sp_size: int = 1, **unused):
        """Returns ``(loss for backward, detached token-sum of the objective, token count)``; with
        ``evaluate`` (held-out evaluation, train/evaluation.py) ``{name: (sum, count)}`` instead."""
        kw = dict(position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                  return_hidden_only=True)
        hidden = self.student(input_ids, **kw).flatten(0, 1)  # [B, T, d] -> [B*T, d]
        teacher_hidden = teacher_weight = None
        split = self.kl_max_position is not None and not evaluate
        if self.teacher is not None:
            with torch.no_grad():
                # SP ranks hold column slices: not prefixes
                if split and cu_seqlens is not None and sp_size == 1:
                    teacher_hidden = self._teacher_prefixes(input_ids, position_ids, cu_seqlens,
                                                            max_seqlen)
                else:  # [B*T, d]; the split loss then keeps the rows inside the teacher's positions
                    teacher_hidden = self.teacher(input_ids, **kw).flatten(0, 1)
                    if split:
                        teacher_hidden = teacher_hidden[
                            position_ids.flatten() < self.kl_max_position]
            teacher_weight = self.teacher.lm_head.weight
        if evaluate:
            return self._evaluate(hidden, teacher_hidden, teacher_weight, labels.flatten())
        if split:
            return self._split_loss(hidden, teacher_hidden, teacher_weight, labels.flatten(),
                                    position_ids.flatten(), normalizer)
        use_ce = self.objective == "ce" or self.ce_weight > 0
        with self._gathered_teacher_head():
            out = fused_distill_loss(
                hidden, self.student.lm_head.weight, teacher_hidden, teacher_weight,
                labels=labels.flatten() if use_ce else None, direction=self.direction,
                temperature=self.temperature, kl_weight=0.0 if self.objective == "ce" else 1.0,
                ce_weight=1.0 if self.objective == "ce" else self.ce_weight,
                chunk_size=self.chunk_size, normalizer=normalizer, backend=self.backend,
            )
        tracked = out.ce_sum if self.objective == "ce" else out.kl_sum
        count = out.num_ce_tokens if self.objective == "ce" else out.num_tokens
        return out.loss, tracked, count

    def _teacher_prefixes(self, input_ids, position_ids, cu_seqlens, max_seqlen) -> torch.Tensor:
        """The teacher's hidden states at the KL tokens only, ``[N_inside, d]`` in the batch's
        flattened order.

        Positions restart at 0 in every document (``cu_seqlens``), so the tokens below
        ``kl_max_position`` are a prefix of each document, and under causal attention nothing after
        them is their context. The teacher therefore runs on those prefixes alone, packed as one
        row: at twice its trained length this halves its linear work and quarters its attention,
        with the same hidden states."""
        limit = self.kl_max_position
        inside = position_ids.flatten() < limit  # [B*T] bool
        # [S] tokens kept per document
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).clamp(max=limit)
        prefix_cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(cu_seqlens.dtype)  # [S+1]
        ids = input_ids.flatten()[inside].unsqueeze(0)  # [B*T] -> [1, N_inside]
        pos = position_ids.flatten()[inside].unsqueeze(0)
        longest = limit if max_seqlen is None else min(int(max_seqlen), limit)
        out = self.teacher(ids, position_ids=pos, cu_seqlens=prefix_cu, max_seqlen=longest,
                           return_hidden_only=True)
        return out.flatten(0, 1)  # [1, N_inside, d] -> [N_inside, d]

    def _split_loss(self, hidden, teacher_hidden, teacher_weight, labels, positions, normalizer):
        """``loss.kl_max_position``: forward KL on the rows whose document position is below it,
        next-token CE on the rest; one normalizer (the loss tokens of both parts) keeps it a
        per-token mean.
        ``teacher_hidden`` holds the inside rows only."""
        inside = positions < self.kl_max_position  # [B*T] bool
        s_w = self.student.lm_head.weight
        with self._gathered_teacher_head():
            kl = fused_distill_loss(hidden[inside], s_w, teacher_hidden, teacher_weight,
                                    labels=labels[inside] if self.ce_weight > 0 else None,
                                    direction=self.direction, temperature=self.temperature,
                                    ce_weight=self.ce_weight, chunk_size=self.chunk_size,
                                    normalizer=normalizer, backend=self.backend)
        ce = fused_distill_loss(hidden[~inside], s_w, None, None, labels=labels[~inside],
                                kl_weight=0.0, ce_weight=1.0, chunk_size=self.chunk_size,
                                normalizer=normalizer, backend=self.backend)
        return kl.loss + ce.loss, kl.kl_sum + ce.ce_sum, kl.num_tokens + ce.num_ce_tokens

    def _evaluate(self, hidden, teacher_hidden, teacher_weight, labels) -> dict:
        """Held-out sums: forward KL(teacher || student) per token, student and teacher next-token
        CE."""
        out = {}
        with self._gathered_teacher_head():
            student = fused_distill_loss(hidden, self.student.lm_head.weight,
                                         teacher_hidden, teacher_weight, labels=labels,
                                         kl_weight=0.0 if teacher_hidden is None else 1.0,
                                         ce_weight=1.0, chunk_size=self.chunk_size)
            out["ce"] = (student.ce_sum, student.num_ce_tokens)
            if teacher_hidden is not None:
                out["kl"] = (student.kl_sum, student.num_tokens)
                teacher = fused_distill_loss(teacher_hidden, teacher_weight, None, None,
                                             labels=labels, kl_weight=0.0, ce_weight=1.0,
                                             chunk_size=self.chunk_size)
                out["teacher_ce"] = (teacher.ce_sum, teacher.num_ce_tokens)
        return out

    def _gathered_teacher_head(self):
        """A ZeRO-3-sharded teacher needs its lm_head gathered for the loss; a replicated one does
        not."""
        t = self.teacher
        if t is None or not hasattr(t.lm_head.weight, "ds_id"):
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters([t.lm_head.weight], modifier_rank=None)
