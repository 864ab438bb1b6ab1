"""HypeNet model package. Every module here but this one is exported verbatim with each checkpoint
(halo_dist/models/export.py MODEL_FILES), so they import only torch, transformers and each other."""

from .cache_hypenet import HypeNetCache
from .configuration_hypenet import HypeNetConfig
from .layers_hypenet import SequenceInfo
from .modeling_hypenet import HypeNetForCausalLM, HypeNetModel

__all__ = ["HypeNetConfig", "HypeNetForCausalLM", "HypeNetModel", "HypeNetCache", "SequenceInfo"]
