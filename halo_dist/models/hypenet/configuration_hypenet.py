"""HypeNet configuration.

Self-contained on purpose: an exported HypeNet folder carries this file and loads with
``AutoConfig.from_pretrained(folder, trust_remote_code=True)`` without halo_dist installed.
Every HyPE design choice is a switch here so the paper's ablations (Table 3) are configs.
"""

from __future__ import annotations

import math

from transformers import PretrainedConfig

# Every name here is a key of modeling_hypenet.MIXER_CLASSES. "swa" is softmax attention over a
# sliding window (SWAN-GPT's local layers); the others besides "attention" are RNNs.
IMPLEMENTED_MIXERS = ("attention", "lightning", "gdn", "gla", "rwkv7", "mamba2", "swa")
RNN_OUTPUT_NORMS = ("per_head", "all_heads")
LIGHTNING_DECAYS = ("hype", "alibi")  # ops_rnn.lightning_log_decay
RNN_MIXERS = ("lightning", "gdn", "gla", "rwkv7", "mamba2")


class HypeNetConfig(PretrainedConfig):
    """Configuration of a HypeNet hybrid (softmax attention + Lightning-Attention RNN layers).

    Shapes follow the teacher: ``hidden_size`` d, ``num_attention_heads`` H query heads of
    ``head_dim`` d_h, ``num_key_value_heads`` KV heads for the attention layers.

    HyPE switches (defaults are the paper's HypeNet):
      rnn_rope (True)            RoPE on q/k inside RNN layers ("RoPE in RNN").
      attn_rope (False)          RoPE in attention layers (False = NoPE, the paper's choice).
      attn_logits_scale_base (a) scale queries by s_t = ln(t + a) / ln(a), t = position in document;
                                 None disables it.
      rnn_qk_norm (True)         RMSNorm on RNN q/k (copied from the teacher's q_norm/k_norm).
      attn_qk_norm (None)        RMSNorm on attention q/k; None = whatever the teacher had.
      rnn_output_gate / attn_output_gate (True)  sigmoid output gates.
      output_gate_scale (2.0)    gate = scale * sigmoid(x W_z); with W_z = 0 at conversion the gate
                                 starts at exactly 1, so a gated layer starts as its teacher.
      attn_output_norm (False)   per-head RMSNorm on the attention output (paper appendix; off by
                                 default because a fresh norm changes the teacher's function).
      rnn_gqa_to_mha (True)      every RNN head gets its own W_k/W_v (cloned from its KV head);
                                 False keeps shared GQA k/v in RNN layers.

    Numerical choices where the authors' reference code differs (``halo-dist import-official`` sets
    theirs; ours are the defaults):
      rnn_output_norm ("per_head")  RMSNorm of the RNN output over each head's d_h ("per_head")
                                 or over all H*d_h at once ("all_heads", the reference code's).
      lightning_decay ("hype")   log γ_h = -2^(-8h/H) ("hype") or minus ALiBi's slopes ("alibi", the
                                 reference code's), which interleave when H is not a power of two.

    Sweep mixers (``mixer_types`` entries): "gdn", "gla", "rwkv7", "mamba2" take the RNN switches
    above; "swa" layers attend to the last ``sliding_window`` tokens of their document, with RoPE if
    ``swa_rope`` (SWAN-GPT: SWA-512 RoPE layers + full-attention NoPE layers), the attention QK-norm
    / output gate / output norm switches, and no logits scaling (a window needs no length scaling).
    ``rnn_layers`` lists every layer that is not full attention (SWA layers included).
    """

    model_type = "hypenet"
    keys_to_ignore_at_inference = ["cache"]

    def __init__(
        self,
        # shape (Qwen3-1.7B's by default)
        vocab_size: int = 151936, hidden_size: int = 2048, intermediate_size: int = 6144,
        num_hidden_layers: int = 28, num_attention_heads: int = 16, num_key_value_heads: int = 8,
        head_dim: int | None = 128, hidden_act: str = "silu",
        max_position_embeddings: int = 1048576,
        rms_norm_eps: float = 1e-6, rope_theta: float = 1e6, tie_word_embeddings: bool = True,
        qkv_bias: bool = False, o_bias: bool = False, mlp_bias: bool = False,
        # mixers and HyPE
        mixer_types: list[str] | None = None, rnn_rope: bool = True, attn_rope: bool = False,
        attn_logits_scale_base: float | None = 500.0, rnn_qk_norm: bool = True,
        attn_qk_norm: bool = True, rnn_output_gate: bool = True, attn_output_gate: bool = True,
        output_gate_scale: float = 2.0, attn_output_norm: bool = False, rnn_gqa_to_mha: bool = True,
        rnn_output_norm: str = "per_head", lightning_decay: str = "hype",
        lightning_chunk_size: int = 64, sliding_window: int | None = 512,
        swa_rope: bool = True, initializer_range: float = 0.02,
        # tokens
        pad_token_id: int | None = None, bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = float(rope_theta)
        self.qkv_bias = qkv_bias
        self.o_bias = o_bias
        self.mlp_bias = mlp_bias
        self.mixer_types = (list(mixer_types) if mixer_types is not None
                            else default_mixer_types(num_hidden_layers))
        self.rnn_rope = rnn_rope
        self.attn_rope = attn_rope
        self.attn_logits_scale_base = (None if attn_logits_scale_base is None
                                       else float(attn_logits_scale_base))
        self.rnn_qk_norm = rnn_qk_norm
        self.attn_qk_norm = attn_qk_norm
        self.rnn_output_gate = rnn_output_gate
        self.attn_output_gate = attn_output_gate
        self.output_gate_scale = float(output_gate_scale)
        self.attn_output_norm = attn_output_norm
        self.rnn_gqa_to_mha = rnn_gqa_to_mha
        self.rnn_output_norm = rnn_output_norm
        self.lightning_decay = lightning_decay
        self.lightning_chunk_size = lightning_chunk_size
        self.sliding_window = sliding_window
        self.swa_rope = swa_rope
        self.initializer_range = initializer_range
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, tie_word_embeddings=tie_word_embeddings,
                         **kwargs)
        self.validate_hypenet()

    @property
    def attn_layers(self) -> list[int]:
        """0-based indices of the softmax-attention layers."""
        return [i for i, m in enumerate(self.mixer_types) if m == "attention"]

    @property
    def rnn_layers(self) -> list[int]:
        return [i for i, m in enumerate(self.mixer_types) if m != "attention"]

    def validate_hypenet(self) -> None:
        """Reject impossible settings with a message naming the field (raised before any
        allocation)."""
        if len(self.mixer_types) != self.num_hidden_layers:
            raise ValueError(
                f"mixer_types has {len(self.mixer_types)} entries but "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        for i, m in enumerate(self.mixer_types):
            if m not in IMPLEMENTED_MIXERS:
                raise ValueError(f"mixer_types[{i}]={m!r} is unknown; choose from "
                                 f"{IMPLEMENTED_MIXERS}")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"sliding_window={w!r} must be a positive integer (tokens each query "
                             "sees) or None")
        if "swa" in self.mixer_types and w is None:
            raise ValueError("mixer_types has 'swa' layers but sliding_window is None; set e.g. "
                             "sliding_window=512")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads} (GQA needs whole query groups)"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        a = self.attn_logits_scale_base
        if a is not None and (not math.isfinite(a) or a <= 1.0):
            raise ValueError(f"attn_logits_scale_base={a} must be > 1 (log base) or None to "
                             "disable scaling")
        if self.output_gate_scale <= 0:
            raise ValueError(f"output_gate_scale={self.output_gate_scale} must be positive")
        if self.rnn_output_norm not in RNN_OUTPUT_NORMS:
            raise ValueError(f"rnn_output_norm={self.rnn_output_norm!r} is unknown; choose from "
                             f"{RNN_OUTPUT_NORMS}")
        if self.lightning_decay not in LIGHTNING_DECAYS:
            raise ValueError(f"lightning_decay={self.lightning_decay!r} is unknown; choose from "
                             f"{LIGHTNING_DECAYS}")
        if self.lightning_chunk_size < 1:
            raise ValueError(f"lightning_chunk_size={self.lightning_chunk_size} must be >= 1")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r}: only SwiGLU ('silu') MLPs are "
                             "supported")


def default_mixer_types(num_layers: int, num_attn: int | None = None) -> list[str]:
    """Evenly spaced attention layers (k = floor(L/4) by default), the rest Lightning."""
    k = num_layers // 4 if num_attn is None else num_attn
    attn = {round(i * num_layers / k) for i in range(k)} if k else set()
    return ["attention" if i in attn else "lightning" for i in range(num_layers)]
