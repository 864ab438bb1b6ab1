"""Checkpoint files are read with ``torch.load(weights_only=True)``: tensors, containers and plain
values only, never an arbitrary pickled callable. A crafted ``.pt`` in a run folder (or one copied
from elsewhere) then cannot run code when a run resumes or a checkpoint is exported.

DeepSpeed's stock checkpoint engine and its ``zero_to_fp32`` would unpickle anything; we never let
them.
Every engine we build gets a checkpoint engine whose ``load`` is :func:`safe_load`
(``install_safe_loading``, called by ``initialize_engine``); DeepSpeed code that calls
``torch.load`` itself (``zero_to_fp32`` in export, the universal-checkpoint conversion when a run
resumes on another number of ranks) runs inside :func:`forced_weights_only`. The only non-tensor
types DeepSpeed stores in ZeRO 0-3 checkpoints are allowed by name (:func:`deepspeed_safe_globals`);
a file that needs anything else is refused with an error naming the file and the type.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re

import torch

from ..errors import HaloUserError


class UnsafeCheckpointError(HaloUserError, ValueError):
    """A checkpoint file holds pickled objects beyond tensors and the allowed DeepSpeed types."""


def deepspeed_safe_globals() -> list:
    """Classes DeepSpeed pickles into optimizer states: the ZeRO stage enum, the loss scalers and
    the fragment addresses of ZeRO-1/2 and bf16 parameter slices (plain attribute holders and a
    dataclass: unpickling them sets fields and runs no code)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


@contextlib.contextmanager
def _allowing_deepspeed_types():
    """torch's ``safe_globals`` for the DeepSpeed types, safe to nest: torch's own context removes
    its types on exit even when an outer block still allows them, so only the missing ones are added
    here."""
    missing = [g
               for g in deepspeed_safe_globals() if g not in torch.serialization.get_safe_globals()]
    with torch.serialization.safe_globals(missing):
        yield


def safe_load(path, map_location=None, **kwargs):
    """``torch.load(path, weights_only=True)`` with the DeepSpeed types allowed; refuses anything
    else."""
    kwargs.pop("weights_only", None)
    try:
        with _allowing_deepspeed_types():
            return torch.load(path, map_location=map_location, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(f"refusing to load {path}: it holds a pickled "
                                    f"{_refused_type(e)}, which is neither a tensor nor one of the "
                                    "DeepSpeed types allowed. Only load checkpoints you trust; "
                                    f"this file is not as halo_dist wrote it.") from None


def _refused_type(error: pickle.UnpicklingError) -> str:
    """The type torch's weights-only unpickler refused, from its message."""
    found = re.search(r"(?:Unsupported global: GLOBAL|Unsupported operand|global) ([\w.]+)",
                      str(error))
    return found.group(1) if found else str(error).strip().splitlines()[0][:200]


def make_safe_checkpoint_engine(config_params=None):
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class SafeCheckpointEngine(TorchCheckpointEngine):
        """DeepSpeed's torch checkpoint engine, loading with ``weights_only=True`` (module doc)."""

        def load(self, path: str, map_location=None):
            return safe_load(path, map_location=map_location)

    return SafeCheckpointEngine(config_params)


def install_safe_loading(engine) -> None:
    """Make ``engine.load_checkpoint`` read every file through :func:`safe_load`."""
    engine.checkpoint_engine = make_safe_checkpoint_engine(getattr(engine, "_config", None))


@contextlib.contextmanager
def forced_weights_only(what: str):
    """Within the block every ``torch.load`` reads with ``weights_only=True``, even where the caller
    passes ``weights_only=False`` (DeepSpeed's universal-checkpoint conversion and loading do, in
    several modules, and so does ``zero_to_fp32``), with the DeepSpeed types allowed; a file that
    needs more is refused, naming ``what``."""
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"  # read by torch.load at every call
    try:
        with _allowing_deepspeed_types():
            yield
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(f"refusing to load {what}: a file in it holds a pickled "
                                    f"{_refused_type(e)}, which is neither a tensor nor one of the "
                                    "DeepSpeed types allowed. Only load checkpoints "
                                    "you trust.") from None
    finally:
        if previous is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous
