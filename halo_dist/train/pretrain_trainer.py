"""The trainer of stage ``pretrain`` (from scratch; the model, groups and FLOPs are
stages/pretrain.py's)."""

from __future__ import annotations

import torch

from ..stages.pretrain import checked_tokenizer, param_groups, train_flops_per_token, unique_numel
from .trainer import Trainer
from .schedules import make_lr_scheduler


class PretrainTrainer(Trainer):
    """The Trainer with the from-scratch differences: weight decay on matrices only, model FLOPs
    with attention terms for MFU, the scratch tokenizer's check of the shards."""

    several_param_groups = True  # decay / no_decay

    def _optimizer(self):
        o = self.cfg.optim
        groups = param_groups(self.module, o.weight_decay)
        fused = self.device.type == "cuda"
        opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                fused=fused or None, foreach=None if fused else True)
        return opt, make_lr_scheduler(opt, self.schedule)

    def _start_metrics(self) -> None:
        super()._start_metrics()
        student = self.module.student
        # Per trained token, not divided by the world size: MetricsLogger already divides tokens/s.
        # full attention is counted per attended key of each batch's documents by the Trainer (its
        # attn_flops_per_key covers the student's attention layers): 0 keys here
        self.metrics.flops_per_token = train_flops_per_token(student.config, unique_numel(student),
                                                             self.cfg.data.seq_len,
                                                             full_attention_keys=0)

    def _tokenizer_for_check(self):
        """pretrain.model.tokenizer, if it loads: shards made with another tokenizer are refused."""
        return checked_tokenizer(self.cfg)
