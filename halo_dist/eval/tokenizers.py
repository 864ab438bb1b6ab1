"""A byte-level Hugging Face tokenizer for tokenizer-less tiny models (``opd.tokenizer: bytes``, the
tests).

Ids 0..255 are the raw UTF-8 bytes; ``<eos>`` = 256 and ``<pad>`` = 257, so a model with a
vocabulary of at least 258 entries accepts every id. Text round-trips exactly and one byte is one
token, which keeps token-length arithmetic in tests obvious.

``tokenizer_identity`` says whether two tokenizer objects turn text into the same ids (prompt caches
and reference figures are keyed by it).
"""

from __future__ import annotations

import hashlib
import json

BYTE_VOCAB = 258


def byte_tokenizer():
    """Return a ``PreTrainedTokenizerFast`` over raw bytes (vocab 258, eos 256, pad 257)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # the 256 printable stand-ins of GPT-2 byte-level BPE
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=1 << 24)
    tok.add_special_tokens({"eos_token": "<eos>", "pad_token": "<pad>"})
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenization
    emits)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def tokenizer_identity(tokenizer) -> str:
    """sha256 of what turns text into ids: a fast tokenizer's serialisation (normaliser,
    pre-tokeniser, vocabulary, merges, added tokens) without its padding and truncation state, which
    transformers changes per call; else the vocabulary and the tokenizer's class."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("padding", None), spec.pop("truncation", None)
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
    from ..data.manifest import vocab_sha256

    return f"{type(tokenizer).__name__}:{vocab_sha256(tokenizer)}"
