"""HypeNet model package. The three *_hypenet.py files are exported verbatim with every checkpoint."""

from .configuration_hypenet import HypeNetConfig
from .modeling_hypenet import HypeNetCache, HypeNetForCausalLM, HypeNetModel, SequenceInfo

__all__ = ["HypeNetConfig", "HypeNetForCausalLM", "HypeNetModel", "HypeNetCache", "SequenceInfo"]
