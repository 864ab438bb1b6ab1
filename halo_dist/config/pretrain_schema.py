"""The ``pretrain:`` section of stage ``pretrain``: which from-scratch variant, and the random
model's shape.

Layout::

    pretrain:
      arch: hypenet        # the variant: transformer | swan | hypenet
      sliding_window: null # arch=swan only
      model:               # shape + init of the randomly initialised model (HypeNetConfig names)
        vocab_size: 50304
        num_hidden_layers: 28
        ...

The variant's choices (``arch``, ``sliding_window``) sit apart from the shape (``pretrain.model``)
because the shape's fields are ``HypeNetConfig``'s names, passed through as they are and checked
together as one shape (as ``model.random_teacher`` is), while the choices are not config fields of
the model; a sweep varies ``pretrain.arch`` over one shared ``pretrain.model``. The variant also
reads ``model:`` fields that the distilled students read too (``pe``, ``rnn_mixer``,
``attn_layers``, logits scaling, output gate, ``dtype``, ``compile``, ``activation_checkpointing``):
they stay in ``model:``, and the checks that relate them to ``pretrain.arch`` are
:class:`halo_dist.config.schema.RunConfig`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from .coerce import fail
from .section import Section, _positive

PretrainArch = Literal["transformer", "swan", "hypenet"]

# Keys of the pretrain section that a config may still place under model:. Such a key is unknown
# there; the error names where it belongs (halo_dist.config.coerce.with_suggestions).
MOVED_KEYS: dict[str, str] = {"model.arch": "pretrain.arch",
                              "model.sliding_window": "pretrain.sliding_window",
                              "model.scratch": "pretrain.model"}


@dataclass(kw_only=True, frozen=True)
class PretrainModelConfig(Section):
    """Shape and initialisation of the randomly initialised model that stage ``pretrain`` trains.

    Field names are ``HypeNetConfig``'s. RNN layers have ``num_attention_heads`` heads of
    ``head_dim`` (HypeNet's RNN heads are the attention's query heads; paper Table 13: 16 and 16).
    Init (halo_dist/stages/pretrain.py): every matrix and the embedding ~ N(0, init_std²), output
    projections (mixer ``o_proj``, MLP ``down_proj``) ~ N(0, init_std² / (2 · num_hidden_layers)),
    norms 1, output-gate weights 0 (gate = 1 at the start).
    """

    vocab_size: int  # GPT-2's 50,257 padded to 50,304 for the sweeps
    num_hidden_layers: int
    hidden_size: int  # model width d
    intermediate_size: int  # SwiGLU FFN width
    num_attention_heads: int  # query heads (attention) = heads (RNN layers)
    num_key_value_heads: int  # KV heads of the attention layers (GQA); must divide the query heads
    head_dim: int  # d_h; even (RoPE)
    tie_word_embeddings: bool = True
    rope_theta: float = 50_000.0  # paper Table 13 (every variant)
    qk_norm: bool = True  # RMSNorm on q/k of attention and Lightning layers (Table 13: yes)
    max_position_embeddings: int = 1_048_576  # only recorded in the exported config
    # HF id/folder: exported with the model and checked against the shards
    tokenizer: Optional[str] = None
    init_std: float = 0.02
    init_seed: int = 0  # every rank (and a resumed run's first build) draws the same weights

    def validate(self) -> None:
        for name in ("vocab_size", "num_hidden_layers", "hidden_size", "intermediate_size",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings", "rope_theta", "init_std"):
            _positive(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            fail("num_key_value_heads", f"{self.num_key_value_heads} does not divide "
                 f"num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            fail("head_dim", f"{self.head_dim} must be even (rotary embeddings)")


@dataclass(kw_only=True, frozen=True)
class PretrainConfig(Section):
    """From-scratch pretraining (the architecture sweeps): the variant and the model it builds."""

    arch: PretrainArch  # transformer (all attention, RoPE) | swan | hypenet
    sliding_window: Optional[int] = None  # arch=swan: window of the SWA RoPE layers; null = 512
    model: PretrainModelConfig  # shape + init of the randomly initialised model

    def validate(self) -> None:
        if self.sliding_window is not None:
            if self.arch != "swan":
                fail("sliding_window", f"only used by arch=swan, not arch={self.arch}")
            _positive("sliding_window", self.sliding_window)
