"""Shared test set-up: single-threaded torch, a repo-local asset cache, tiny model factories, shared
fixtures."""

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HALO_CACHE", str(REPO / ".cache" / "halo_dist"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.cuda`` tests (GPU-only paths: Triton kernels, CUDA graphs) skip without a GPU;
    ``bash bench/gpu.sh cuda`` runs them on one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (bash bench/gpu.sh cuda runs it)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


def tiny_qwen3(tie: bool = False, seed: int = 0, layers: int = 4, heads: int = 4, kv_heads: int = 2,
               vocab: int = 256):
    """A random Qwen3 with weights large enough that layer differences show in the logits."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
        tie_word_embeddings=tie, rope_theta=10000.0, eos_token_id=1, bos_token_id=0, pad_token_id=2,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            else:
                p.normal_(1.0, 0.1)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (the GPU checks' error against their references)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


@pytest.fixture
def qwen3_teacher():
    return tiny_qwen3()


@pytest.fixture(scope="session")
def smollm2_dir():
    from halo_dist.teacher import smollm2_teacher_dir

    return smollm2_teacher_dir()


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    """Real Wikipedia shards (300 documents, 5% held out) in configs/tiny's small BPE vocabulary,
    built once per session: tests read them (one that damages data works on a copy)."""
    from data_fixtures import TINY_TOKENIZER, run_prep

    out = tmp_path_factory.mktemp("wiki") / "data"
    run_prep(out, max_docs=300, shard_tokens=8000, heldout_fraction=0.05, tokenizer=TINY_TOKENIZER)
    return out


def assert_left_padded_generate_matches_alone(model, prompts, new_tokens: int,
                                              pad_token_id: int) -> None:
    """Greedy ``generate`` of left-padded prompts equals each prompt generated alone (no EOS
    stop)."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_token_id)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):], mask[i, T - len(p):] = p, 1
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=[],
                             pad_token_id=pad_token_id)
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=new_tokens, eos_token_id=[])
        assert torch.equal(batched[i, T:], alone[0, len(p):]), f"row {i} differs"


def pytest_collection_finish(session):
    """The real-Slurm scenario (tests/slurm_real.py) starts in the background as soon as a collected
    test needs it: its jobs get the CPU time the other tests leave unused
    (scripts/local_slurm.sh)."""
    if session.config.option.collectonly:
        return
    if any("slurm_scenario" in getattr(item, "fixturenames", ()) for item in session.items):
        import slurm_real

        slurm_real.start(session.config._tmp_path_factory)


def pytest_sessionfinish(session, exitstatus):
    import sys

    if "slurm_real" in sys.modules:
        sys.modules["slurm_real"].finish(passed=session.testsfailed == 0)
