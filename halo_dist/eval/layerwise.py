"""Evaluate M(i) for every layer i with work reuse.

M(i) = the teacher with only layer i replaced by its stage-1 RNN. With RoPE kept, no logits scaling
and no gates, an all-attention HypeNet *is* the teacher (tests/test_hypenet.py), so we:

1. convert the teacher once into that exact all-attention ``base`` (the HF teacher can then be
   freed);
2. build layer i's RNN mixer from the stage-1 file (missing keys fall back to the stage-0 transfer,
   exactly as ``convert_model`` does) and swap it into ``base`` in place (:func:`swapped_mixer`);
3. for forward-only probes, cache the teacher's hidden states *entering* layer i and run only
   layers i..L-1 of M(i) (:class:`LayerwiseRunner`); after layer i is scored the cache advances
   through the teacher's own layer i. Total cost ~L²/2 layer-forwards instead of L².

The loop (:func:`evaluate_layers`) writes the results file after every layer and skips layers
already present when resuming.
"""

from __future__ import annotations

import contextlib
import copy
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..models.convert import convert_model, transfer_state_dict
from ..models.hypenet.layers_hypenet import sequence_info
from ..models.hypenet.rnn_hypenet import LightningMixer
from .errors import EvalError
from .selection import load_results, save_results

EXACT_TEACHER = dict(attn_rope=True, attn_logits_scale_base=None, attn_output_gate=False)


def teacher_as_hypenet(teacher) -> "torch.nn.Module":
    """All-attention HypeNet whose function is exactly the teacher's (the base of every M(i))."""
    L = teacher.config.num_hidden_layers
    return convert_model(teacher, list(range(L)), **EXACT_TEACHER)


# ------------------------------------------------------------------------------------------------
# Stage-1 RNN mixers
# ------------------------------------------------------------------------------------------------


class Stage1Weights:
    """A stage-1 safetensors file (keys ``model.layers.{i}.mixer.*``), checked against ``base``.

    Everything is validated from the header (names, shapes, metadata) before any layer is evaluated;
    tensors are read lazily, one layer at a time.
    """

    def __init__(self, path: str | Path, base):
        from safetensors import safe_open

        self.path, self.base = Path(path), base
        if not self.path.is_file():
            raise FileNotFoundError(f"stage-1 weights file {self.path} does not exist")
        self.num_layers = base.config.num_hidden_layers
        try:
            self._file = safe_open(str(self.path), "pt")
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise EvalError(f"stage-1 weights {self.path} are not a readable safetensors file: "
                            f"{e}") from None
        self.keys_by_layer = self._check()
        self.mixer_config = self._mixer_config()

    def _expected_shapes(self) -> dict[str, tuple]:
        with torch.device("meta"):
            mixer = LightningMixer(self.base.config, 0)
        return {k: tuple(v.shape) for k, v in mixer.state_dict().items()}

    def _mixer_config(self):
        """``base``'s config with the RNN RoPE stage 1 aligned the layers with (``model.pe``; files
        from before it have no key: RoPE on), so that M(i) runs layer i as stage 1 trained it."""
        cfg = copy.deepcopy(self.base.config)
        cfg.rnn_rope = (self._file.metadata() or {}).get("rnn_rope", "true") == "true"
        return cfg

    def _check(self) -> dict[int, list[str]]:
        meta = self._file.metadata() or {}
        if "num_hidden_layers" in meta and int(meta["num_hidden_layers"]) != self.num_layers:
            raise EvalError(
                f"stage-1 weights {self.path} were trained for {meta['num_hidden_layers']} layers, "
                f"the teacher has {self.num_layers}"
            )
        expected = self._expected_shapes()
        by_layer: dict[int, list[str]] = {}
        for key in self._file.keys():
            layer, name = _split_mixer_key(key)
            if layer is None or not 0 <= layer < self.num_layers or name not in expected:
                raise EvalError(f"stage-1 weights {self.path}: key {key!r} is not an RNN-mixer "
                                "parameter of this teacher")
            shape = tuple(self._file.get_slice(key).get_shape())
            if shape != expected[name]:
                raise EvalError(
                    f"stage-1 weights {self.path}: {key!r} has shape {shape}, this teacher's RNN "
                    f"layer needs {expected[name]}"
                )
            by_layer.setdefault(layer, []).append(key)
        return by_layer

    def require_layers(self, layers: list[int]) -> None:
        missing = [i for i in layers if i not in self.keys_by_layer]
        if missing:
            raise EvalError(f"stage-1 weights {self.path} hold no RNN weights for layers {missing}")

    def mixer(self, i: int) -> LightningMixer:
        """Layer i's RNN mixer: stage-0 transfer from the teacher's attention, overwritten by the
        file."""
        state = transferred_rnn_state(self.base, i)
        for key in self.keys_by_layer.get(i, []):
            state[_split_mixer_key(key)[1]] = self._file.get_tensor(key)
        ref = self.base.model.layers[i].mixer.q_proj.weight
        with torch.device("meta"):
            mixer = LightningMixer(self.mixer_config, i)
        mixer.load_state_dict({k: v.to(ref.dtype) for k, v in state.items()}, strict=True,
                              assign=True)
        return mixer.to(ref.device).eval()


def _split_mixer_key(key: str) -> tuple[int | None, str | None]:
    """``model.layers.7.mixer.q_proj.weight`` -> ``(7, "q_proj.weight")``."""
    parts = key.split(".")
    if (len(parts) < 5 or parts[:2] != ["model", "layers"] or parts[3] != "mixer"
            or not parts[2].isdigit()):
        return None, None
    return int(parts[2]), ".".join(parts[4:])


def transferred_rnn_state(base, i: int) -> dict[str, torch.Tensor]:
    """Stage-0 RNN weights for layer i built from ``base``'s (= the teacher's) attention layer i.

    Reuses ``transfer_state_dict`` on a one-layer view, so GQA->MHA cloning, q/k norms, the zero
    gate and the per-head output norm are exactly those of a full conversion.
    """
    cfg = copy.deepcopy(base.config)
    cfg.num_hidden_layers, cfg.mixer_types = 1, ["lightning"]
    placeholder = torch.empty(0)
    view = {k: placeholder for k in ("model.embed_tokens.weight", "model.norm.weight",
                                     "lm_head.weight", "model.layers.0.input_layernorm.weight",
                                     "model.layers.0.post_attention_layernorm.weight")}
    for name, value in base.model.layers[i].mixer.state_dict().items():
        view[f"model.layers.0.self_attn.{name}"] = value.detach()
    prefix = "model.layers.0.mixer."
    return {k[len(prefix):]: v
            for k, v in transfer_state_dict(view, cfg).items() if k.startswith(prefix)}


@contextlib.contextmanager
def swapped_mixer(base, i: int, mixer):
    """Temporarily make ``base`` into M(i) by putting ``mixer`` at layer i."""
    layer = base.model.layers[i]
    original = layer.mixer
    layer.mixer = mixer
    try:
        yield base
    finally:
        layer.mixer = original


# ------------------------------------------------------------------------------------------------
# Prefix-cached forward passes
# ------------------------------------------------------------------------------------------------


class LayerwiseRunner:
    """Forward passes of M(i) over fixed batches, reusing the teacher's hidden states below layer i.

    ``batches``: dicts with ``input_ids`` [B, T] and optionally ``position_ids`` / ``cu_seqlens`` /
    ``max_seqlen`` (packed documents). Layers must be visited in increasing order.
    """

    def __init__(self, base, batches: list[dict]):
        self.base, self.batches = base, batches
        self.device = base.model.embed_tokens.weight.device
        self.infos = [self._info(b) for b in batches]
        with torch.no_grad():
            self.hidden = [base.model.embed_tokens(b["input_ids"].to(self.device)) for b in batches]
        self.layer = 0  # the layer the cached states enter
        self._teacher_final: list[torch.Tensor] | None = None

    def _info(self, batch: dict):
        ids = batch["input_ids"]
        move = lambda t: None if t is None else t.to(self.device)  # noqa: E731
        return sequence_info(tuple(ids.shape), self.device, move(batch.get("position_ids")), None,
                             move(batch.get("cu_seqlens")), batch.get("max_seqlen"), 0)

    @torch.no_grad()
    def outputs(self, start: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield ``(batch index, final normed hidden [B, T, d])`` running layers ``start``..L-1 on
        the cache."""
        start = self.layer if start is None else start
        if start != self.layer:
            raise RuntimeError(f"cache holds the input of layer {self.layer}, asked to start at "
                               f"{start}")
        layers = self.base.model.layers
        for b, (x, info) in enumerate(zip(self.hidden, self.infos)):
            for j in range(start, len(layers)):
                x = layers[j](x, info)
            yield b, self.base.model.norm(x)

    @torch.no_grad()
    def advance(self) -> None:
        """Push the cache through the *current* (teacher) layer: it now enters layer
        ``self.layer + 1``."""
        layer = self.base.model.layers[self.layer]
        self.hidden = [layer(x, info) for x, info in zip(self.hidden, self.infos)]
        self.layer += 1

    def teacher_final(self) -> list[torch.Tensor]:
        """Final normed hidden states of the teacher itself (computed once, from layer 0)."""
        if self._teacher_final is None:
            if self.layer != 0:
                raise RuntimeError("teacher outputs must be computed before the cache advances")
            self._teacher_final = [h for _, h in self.outputs(0)]
        return self._teacher_final


# ------------------------------------------------------------------------------------------------
# The evaluation loop
# ------------------------------------------------------------------------------------------------


def evaluate_layers(
    base,
    stage1: Stage1Weights,
    evaluator,
    results_path: str | Path | None = None,
    resume: bool = False,
    layers: list[int] | None = None,
    log: Callable[[str], None] = print,
) -> dict[int, dict]:
    """Evaluate M(i) for ``layers`` (default all) in increasing order; return
    ``{i: {"recall", "csr", ...}}``.

    ``evaluator`` has ``start(base)``, ``evaluate(base, i) -> dict`` (called with M(i) in place) and
    ``advance(i)`` (called after layer i, evaluated or skipped). With ``results_path`` the results
    are written after every layer; with ``resume`` layers already in that file are skipped.
    """
    L = base.config.num_hidden_layers
    layers = sorted(range(L) if layers is None else layers)
    stage1.require_layers(layers)
    results = _existing_results(results_path, resume, L)
    pending = [i for i in layers if i not in results]
    if results:
        log(f"resuming: {len(results)} layers already in {results_path}, {len(pending)} to "
            "evaluate")
    if not pending:
        return results
    evaluator.start(base)
    for i in range(max(pending) + 1):
        if i in pending:
            t0 = time.time()
            with swapped_mixer(base, i, stage1.mixer(i)):
                results[i] = evaluator.evaluate(base, i)
            log(f"layer {i:3d}: recall {results[i]['recall']:.4f}  csr {results[i]['csr']:.4f}  "
                f"({time.time() - t0:.1f}s)")
            if results_path is not None:
                save_results(results_path, results)
        evaluator.advance(i)
    return results


def _existing_results(results_path, resume: bool, num_layers: int) -> dict[int, dict]:
    if results_path is None or not resume or not Path(results_path).exists():
        return {}
    results = load_results(results_path)
    extra = [i for i in results if i >= num_layers]
    if extra:
        raise EvalError(f"--resume: {results_path} holds layers {extra}, the teacher has "
                        f"{num_layers} layers")
    return results
