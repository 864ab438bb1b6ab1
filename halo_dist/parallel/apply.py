"""Apply Ulysses sequence parallelism to a HypeNet: validate every mixer's heads, then inject
``sp``.

Each mixer owns its Ulysses logic (models/hypenet/sequence_parallel_hypenet.py: its one forward
wraps q/k/v in all-to-alls before the kernel and the output after it); this module only checks, up
front and without any communication, that every mixer's heads can be split over the SP group, and
then calls ``layer.mixer.apply_sp(sp)``. Checking first means a bad layout fails identically on
every rank with one clear message, instead of inside the first forward's all-to-all (where one rank
may raise while the others wait in the collective).

Head counts come from the mixers' integer attributes (``num_heads``, ``num_kv_heads``), never from
parameter shapes, so this works on a ZeRO-3-partitioned model (whose parameters are empty) and on
a DeepSpeed engine (``engine.module`` is walked like any module). No model import: any module with
``.layers[i].mixer`` objects that have an ``apply_sp`` method is accepted, and so is a plain list of
mixers (:func:`apply_sequence_parallel_to_mixers`).
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from .ulysses import SequenceParallel, SequenceParallelError, kv_replication_factor


def _mixers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, mixer) of every decoder layer, in model order."""
    found = []
    for module in model.modules():
        mixer = getattr(module, "mixer", None)
        if isinstance(mixer, nn.Module):
            found.append((getattr(mixer, "layer_idx", len(found)), mixer))
    if not found:
        raise SequenceParallelError(f"{type(model).__name__} has no decoder layers with a `.mixer` "
                                    "to parallelise")
    return found


def _check_mixer(layer: int, mixer: nn.Module, sp_size: int) -> str | None:
    """Why this mixer cannot run with ``sp_size`` (None if it can)."""
    kind = type(mixer).__name__
    if not callable(getattr(mixer, "apply_sp", None)):
        return (f"layer {layer} ({kind}) has no sequence-parallel implementation (no `apply_sp` "
                "method)")
    heads = int(mixer.num_heads)
    kv_heads = int(getattr(mixer, "num_kv_heads", heads))
    if heads % sp_size:
        return (f"layer {layer} ({kind}): sp_size={sp_size} does not divide its {heads} query "
                f"heads ({kv_heads} KV heads); Ulysses needs sp_size | num_attention_heads")
    try:  # H % sp == 0 and H % Hkv == 0 always leave a replication factor; this guards odd configs
        kv_replication_factor(heads, kv_heads, sp_size)
    except SequenceParallelError as e:
        return (f"layer {layer} ({kind}): {heads} query heads / {kv_heads} KV heads cannot be "
                f"split: {e}")
    return None


def apply_sequence_parallel(model: nn.Module, sp: SequenceParallel | None) -> nn.Module:
    """Validate all mixers for ``sp.world_size``, then ``layer.mixer.apply_sp(sp)`` in every layer.

    Each SP rank then passes its contiguous ``T/sp`` tokens with the matching slice of the GLOBAL
    per-document ``position_ids`` and the FULL sequence's ``cu_seqlens`` / ``max_seqlen``.
    ``sp`` of size 1 (or None) removes sequence parallelism instead: the mixers' SP path has no
    cache and no padding mask, so a size-1 "SP" would only lose features.

    Raises :class:`SequenceParallelError` naming every layer whose heads cannot be split, before
    any mixer is modified and before any communication. Returns ``model``.
    """
    if sp is None or sp.world_size == 1:
        return remove_sequence_parallel(model)
    _inject(_mixers(model), sp)
    return model


def apply_sequence_parallel_to_mixers(mixers: Sequence[nn.Module], sp: SequenceParallel) -> None:
    """:func:`apply_sequence_parallel` for mixers that are not a model's layers (stage 1 trains them
    alone), in layer order; the same check first, the same errors. ``sp`` must span more than one
    rank."""
    if not mixers:
        raise SequenceParallelError("no mixers to parallelise")
    _inject([(getattr(m, "layer_idx", i), m) for i, m in enumerate(mixers)], sp)


def _inject(mixers: list[tuple[int, nn.Module]], sp: SequenceParallel) -> None:
    """Check every ``(layer index, mixer)`` for ``sp.world_size``, then ``mixer.apply_sp(sp)`` in
    each."""
    problems = [p for layer, m in mixers if (p := _check_mixer(layer, m, sp.world_size))]
    if problems:
        raise SequenceParallelError("cannot apply sequence parallelism of size "
                                    f"{sp.world_size}:\n  " + "\n  ".join(problems))
    for _, mixer in mixers:
        mixer.apply_sp(sp)


def remove_sequence_parallel(model: nn.Module) -> nn.Module:
    """Back to single-process mixers (``mixer.apply_sp(None)``), e.g. before generation or
    export."""
    for module in model.modules():
        mixer = getattr(module, "mixer", None)
        if isinstance(mixer, nn.Module) and callable(getattr(mixer, "apply_sp", None)):
            mixer.apply_sp(None)
    return model
