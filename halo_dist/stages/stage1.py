"""HALO stage 1: align every RNN layer to the attention layer it replaces.

All layers are trained at once. Layer l's RNN is fed the teacher's own input to layer l (the
normalised hidden state entering its attention) and regresses the teacher's attention output:
loss = Σ_l MSE(attn_l(x_l), RNN_l(x_l)). Nothing else is trained. The result is one safetensors
file of RNN mixers for every layer (keys ``model.layers.{l}.mixer.*``), which conversion
(``convert --stage1-weights``) and layer selection read.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..models.convert import convert_model
from ..models.hypenet import HypeNetForCausalLM

STAGE1_FILE = "rnn_layers.safetensors"


class TeacherTaps:
    """Forward hooks that record each teacher mixer's input ``x_l`` and output during one
    forward."""

    def __init__(self, teacher: HypeNetForCausalLM):
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.info = None
        self._handles = []
        for i, layer in enumerate(teacher.model.layers):
            self._handles.append(layer.mixer.register_forward_pre_hook(self._pre(i)))
            self._handles.append(layer.mixer.register_forward_hook(self._post(i)))

    def _pre(self, i):
        def hook(module, args):
            self.inputs[i], self.info = args[0], args[1]

        return hook

    def _post(self, i):
        def hook(module, args, output):
            self.outputs[i] = output

        return hook

    def remove(self):
        for h in self._handles:
            h.remove()


class Stage1Aligner(nn.Module):
    """The trainable part of stage 1: one RNN mixer per teacher layer, initialised by weight
    transfer.
    A :class:`~halo_dist.stages.protocol.StageModule`; ``student_config`` is the all-RNN student's
    config."""

    def __init__(self, hf_teacher, teacher: HypeNetForCausalLM, **student_overrides):
        super().__init__()
        all_rnn = convert_model(hf_teacher, [], **student_overrides)  # stage 0: every layer an RNN
        self.student_config = all_rnn.config
        self.mixers = nn.ModuleList(layer.mixer for layer in all_rnn.model.layers)
        del all_rnn
        # a list: the frozen teacher is not a submodule (never saved, not in ZeRO)
        self._teacher = [teacher]
        self.taps = TeacherTaps(teacher)

    @property
    def teacher(self) -> HypeNetForCausalLM:
        return self._teacher[0]

    def loss_tokens(self, batch: dict) -> int:
        """Every input token: each one's MSE counts, summed over layers."""
        return int(batch["input_ids"].numel())

    def sp_mixers(self) -> list[nn.Module]:
        """The RNN mixers (all layers): sequence parallelism is injected into them directly."""
        return list(self.mixers)

    def forward(self, input_ids, position_ids, cu_seqlens=None, max_seqlen=None,
                normalizer: float = 1.0, evaluate: bool = False, **unused):
        """Returns ``(loss for backward, detached sum of per-token layer-summed MSE, token count)``;
        with ``evaluate`` (held-out evaluation, train/evaluation.py) ``{"mse": (sum, count)}``."""
        with torch.no_grad():
            self.teacher(input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens,
                         max_seqlen=max_seqlen, return_hidden_only=True)
        total = input_ids.new_zeros((), dtype=torch.float32)
        for i, mixer in enumerate(self.mixers):
            x, target = self.taps.inputs.pop(i), self.taps.outputs.pop(i)
            pred = mixer(x, self.taps.info)
            # per-token mean over the hidden dim, summed over tokens: a token-weighted MSE
            total = total + (pred.float() - target.float()).pow(2).mean(-1).sum()
        count = input_ids.numel()
        if evaluate:
            return {"mse": (total.detach(), count)}
        return total / normalizer, total.detach(), count


def stage1_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The aligner's weights (a :class:`Stage1Aligner` state dict, under any wrapper prefixes)
    renamed to the student's keys, as CPU tensors: ``mixers.3.q_proj.weight`` ->
    ``model.layers.3.mixer.q_proj.weight``.
    The one naming of the stage-1 file, for the stage's output and ``halo-dist export`` alike."""
    from ..models.export import strip_wrapper_prefixes

    out = {}
    for key, value in strip_wrapper_prefixes(state).items():
        if key.startswith("mixers."):
            _, idx, rest = key.split(".", 2)
            out[f"model.layers.{idx}.mixer.{rest}"] = value.detach().to("cpu").contiguous()
    return out


def save_stage1_weights(weights: dict[str, torch.Tensor], folder: str | Path, num_layers: int,
                        teacher: str, rnn_rope: bool = True, files: dict[str, str] | None = None,
                        overwrite: bool = False, inputs: dict | None = None) -> Path:
    """Write the folder holding the stage-1 file (+ ``files``: name -> text, written after it) at
    once (``outputs.write_output``: an earlier output of ours there is replaced only with
    ``overwrite``; ``inputs`` may not be, hold or lie inside it); returns the file's path.

    The file's metadata holds what conversion checks against: the layer count, and the RNN RoPE of
    ``model.pe`` the layers were aligned with, which a stage-2 student must share."""
    from safetensors.torch import save_file

    from ..outputs import write_output

    def fill(tmp: Path) -> None:
        save_file(weights, str(tmp / STAGE1_FILE),
                  metadata={"num_hidden_layers": str(num_layers), "teacher": str(teacher),
                            "rnn_rope": "true" if rnn_rope else "false"})
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)

    return write_output(folder, fill, "stage1", overwrite=overwrite, inputs=inputs) / STAGE1_FILE


def resolve_stage1_file(path: str | Path) -> Path:
    """Accept the file itself or a stage-1 output folder."""
    path = Path(path)
    return path / STAGE1_FILE if path.is_dir() else path
