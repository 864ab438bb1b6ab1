"""Long-context inference paths on CPU: the preallocated KV cache, chunked prefill, and the inference
benchmark's smoke mode (the CUDA kernels behind the same functions are checked on the device by
bench/check_attention_gpu.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from halo_dist.models.hypenet import HypeNetCache, HypeNetConfig, HypeNetForCausalLM
from halo_dist.models.hypenet.ops_hypenet import chunk_prefill_attention, sdpa

REPO = Path(__file__).resolve().parents[1]


def tiny_model(mixers=("attention", "lightning", "attention", "lightning")) -> HypeNetForCausalLM:
    torch.manual_seed(0)
    cfg = HypeNetConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=len(mixers),
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, mixer_types=list(mixers))
    return HypeNetForCausalLM(cfg).double().eval()


@pytest.mark.parametrize("bounds", [[0, 16, 31, 32, 40], [0, 40], list(range(41))])
def test_chunked_prefill_with_cache_equals_full_forward(bounds):
    """Prefill in uneven chunks (incl. one token at a time) through the cache == one full forward."""
    model = tiny_model()
    ids = torch.randint(0, 97, (1, 40))
    full = model(ids).logits
    cache = HypeNetCache(4, reserve_tokens=3)
    outs = [model(ids[:, a:b], cache=cache, use_cache=True).logits for a, b in zip(bounds[:-1], bounds[1:])]
    assert torch.allclose(torch.cat(outs, 1), full, atol=1e-10)


def test_cache_preallocates_prompt_plus_reserve_and_grows_by_doubling():
    cache = HypeNetCache(1, reserve_tokens=4)
    k = torch.randn(2, 10, 2, 8)
    keys, _ = cache.append_kv(0, k, k)
    buffer = cache._kv_buffers[0][0]
    assert keys.shape == (2, 10, 2, 8) and buffer.shape[1] == 14  # prompt + decode room
    for step in range(4):  # decode inside the reserved room: written in place, no new buffer
        keys, _ = cache.append_kv(0, k[:, :1], k[:, :1])
        assert cache._kv_buffers[0][0] is buffer and keys.shape[1] == 11 + step
    keys, values = cache.append_kv(0, k[:, :1] + 1, k[:, :1] + 1)  # beyond the room: doubling copy
    assert cache._kv_buffers[0][0].shape[1] == 28 and keys.shape[1] == 15
    assert torch.equal(keys[:, :10], k) and torch.equal(keys[:, -1:], k[:, :1] + 1)
    cache.reorder(torch.tensor([1]))  # row selection drops the buffer; the next append regrows
    keys, _ = cache.append_kv(0, k[1:, :1], k[1:, :1])
    assert keys.shape == (1, 16, 2, 8) and torch.equal(keys[0, :10], k[1])


def test_generate_matches_with_reserved_cache():
    model = tiny_model()
    ids = torch.randint(1, 97, (2, 12))
    out = model.generate(ids, max_new_tokens=6)
    # reference: greedy decoding by full forwards without any cache
    seq = ids
    for _ in range(6):
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_chunk_prefill_attention_is_lower_right_causal():
    torch.manual_seed(1)
    q = torch.randn(1, 5, 4, 8, dtype=torch.float64)
    k, v = torch.randn(1, 12, 2, 8, dtype=torch.float64), torch.randn(1, 12, 2, 8, dtype=torch.float64)
    out = chunk_prefill_attention(q, k, v, 0.3)
    for i in range(5):  # query i sees keys 0 .. 7 + i
        ref = sdpa(q[:, i:i + 1], k[:, : 8 + i], v[:, : 8 + i], scale=0.3)
        assert torch.allclose(out[:, i:i + 1], ref, atol=1e-12)


def test_inference_benchmark_smoke(tmp_path):
    out = tmp_path / "inference.json"
    res = subprocess.run([sys.executable, str(REPO / "bench" / "bench_inference.py"), "--cpu-smoke", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["max_context_tokens"] == 256  # the decode-only context ran
    statuses = {(r["model"], r["context"]): r["status"] for r in payload["rows"]}
    assert statuses[("hypenet-2b", 256)] == "decode-only" and statuses[("qwen3-1.7b-shape", 64)] == "ok"
    assert all(r["decode_ms"] > 0 for r in payload["rows"] if r["status"] in ("ok", "decode-only"))
