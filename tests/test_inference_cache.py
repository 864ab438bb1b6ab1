"""Long-context inference paths on CPU: the preallocated KV cache, chunked prefill, and the
inference benchmark's smoke mode (the CUDA kernels behind the same functions are checked on the
device by tests/test_attention_gpu.py)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from halo_dist.models.hypenet import HypeNetCache, HypeNetConfig, HypeNetForCausalLM
from halo_dist.models.hypenet.ops_attention import chunk_prefill_attention, sdpa

REPO = Path(__file__).resolve().parents[1]


def tiny_model(mixers=("attention", "lightning", "attention", "lightning")) -> HypeNetForCausalLM:
    torch.manual_seed(0)
    cfg = HypeNetConfig(vocab_size=97, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=len(mixers), num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, mixer_types=list(mixers))
    return HypeNetForCausalLM(cfg).double().eval()


@pytest.mark.parametrize("bounds", [[0, 16, 31, 32, 40], [0, 40], list(range(41))])
def test_chunked_prefill_with_cache_equals_full_forward(bounds):
    """Prefill in uneven chunks (incl. one token at a time) through the cache == one full
    forward."""
    model = tiny_model()
    ids = torch.randint(0, 97, (1, 40))
    full = model(ids).logits
    cache = HypeNetCache(4, reserve_tokens=3)
    outs = [model(ids[:, a:b], cache=cache, use_cache=True).logits
            for a, b in zip(bounds[:-1], bounds[1:])]
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
    cache.reorder_cache(torch.tensor([1]))  # row selection keeps the buffer's room
    keys, _ = cache.append_kv(0, k[1:, :1], k[1:, :1])
    assert (keys.shape == (1, 16, 2, 8) and torch.equal(keys[0, :10], k[1])
            and cache._kv_buffers[0][0].shape[1] == 28)


def test_generate_matches_with_reserved_cache():
    model = tiny_model()
    ids = torch.randint(1, 97, (2, 12))
    out = model.generate(ids, max_new_tokens=6)
    # reference: greedy decoding by full forwards without any cache
    seq = ids
    for _ in range(6):
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


@pytest.mark.parametrize("mixers,impl",
                         [(("lightning", "gdn"), None), (("attention", "lightning"), None),
                          (("attention", "lightning"), "static")])
def test_generate_continues_from_the_cache_it_returned(mixers, impl):
    """transformers slices a restarted cache's tokens off the input only when some layer holds keys;
    an RNN-only cache counts its tokens too. A static cache continued past its buffers goes on with
    dynamic steps."""
    model = tiny_model(mixers)
    ids = torch.randint(1, 97, (2, 9))
    first = model.generate(ids, max_new_tokens=3, return_dict_in_generate=True,
                           cache_implementation=impl)
    # the field's name before transformers' rename
    cache = first.cache if "cache" in first else first.past_key_values
    more = model.generate(first.sequences, cache=cache, max_new_tokens=6)
    assert torch.equal(more, model.generate(ids, max_new_tokens=9))


def test_chunk_prefill_attention_is_lower_right_causal():
    torch.manual_seed(1)
    q = torch.randn(1, 5, 4, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 12, 2, 8, dtype=torch.float64),
            torch.randn(1, 12, 2, 8, dtype=torch.float64))
    out = chunk_prefill_attention(q, k, v, 0.3)
    for i in range(5):  # query i sees keys 0 .. 7 + i
        ref = sdpa(q[:, i:i + 1], k[:, : 8 + i], v[:, : 8 + i], scale=0.3)
        assert torch.allclose(out[:, i:i + 1], ref, atol=1e-12)


@pytest.mark.slow
def test_inference_benchmark_smoke(tmp_path):
    out = tmp_path / "inference.json"
    res = subprocess.run([sys.executable, str(REPO / "bench" / "bench_inference.py"), "--cpu-smoke",
                          "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["max_context_tokens"] == 256  # the decode-only context ran
    statuses = {(r["model"], r["context"]): r["status"] for r in payload["rows"]}
    assert (statuses[("hypenet-2b", 256)] == "decode-only"
            and statuses[("qwen3-1.7b-shape", 64)] == "ok")
    assert all(r["decode_ms"] > 0 for r in payload["rows"] if r["status"] in ("ok", "decode-only"))


def load_bench_inference():
    """bench/ is a script folder, not an installed package: load the module from its file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_inference",
                                                  REPO / "bench" / "bench_inference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def real_pair_folders(tmp_path_factory):
    """A tiny random Llama teacher folder and the HypeNet converted from it, exported (attention in
    layer 1)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from halo_dist.models.convert import convert_model
    from halo_dist.models.export import export_hypenet

    root = tmp_path_factory.mktemp("real_pair")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=512)
    teacher = LlamaForCausalLM(cfg).eval()
    teacher.save_pretrained(root / "teacher")
    export_hypenet(convert_model(teacher, [1]), root / "student")
    return root / "teacher", root / "student"


def test_real_pair_benchmark_smoke(real_pair_folders, tmp_path):
    """--real on CPU: one row per context, both models timed, ratios student / teacher; importable
    in-process."""
    bench = load_bench_inference()
    teacher_dir, student_dir = real_pair_folders
    out = tmp_path / "real.json"
    payload = bench.main(["--real", str(teacher_dir), str(student_dir), "--cpu-smoke", "--out",
                          str(out)])
    saved = json.loads(out.read_text())
    assert [r["context"] for r in saved["rows"]] == [64, 128] == payload["contexts"]
    for r in saved["rows"]:
        assert r["status"] == "ok"
        for who in ("teacher", "student"):
            assert (r[f"{who}_prefill_s"] > 0 and r[f"{who}_prefill_tok_s"] > 0
                    and r[f"{who}_decode_ms"] > 0)
        assert r["prefill_tok_s_ratio"] == pytest.approx(r["student_prefill_tok_s"]
                                                         / r["teacher_prefill_tok_s"])
        assert r["decode_ms_ratio"] == pytest.approx(r["student_decode_ms"]
                                                     / r["teacher_decode_ms"])
    assert saved["decode"] == "eager" and saved["teacher"]["mixers"] == ["attention"]
    assert saved["student"]["attention_layers"] == [1] and "lightning" in saved["student"]["mixers"]
    assert out.with_suffix(".png").exists()
    with pytest.raises(SystemExit):  # shape-mode options are refused, not ignored
        bench.parse_args(["--real", str(teacher_dir), str(student_dir), "--decode-only", "256"])


@pytest.mark.slow
def test_decode_profile_smoke_compares_every_variant_with_the_eager_step(tmp_path):
    """bench/profile_decode.py end to end on CPU: every StaticDecoder variant after a real prefill
    gives the eager dynamic step's logits (fp32), and the bytes bound counts KV and states per
    row."""
    out = tmp_path / "decode_profile.json"
    res = subprocess.run([sys.executable, str(REPO / "bench" / "profile_decode.py"), "--cpu-smoke",
                          "--prefill", "--variants", "graph", "baseline", "separate", "fla",
                          "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 8 and all(r["rel_err_vs_eager"] < 1e-5 and r["step_ms"] > 0 for r in rows)
    bench = importlib.util.spec_from_file_location("profile_decode",
                                                   REPO / "bench" / "profile_decode.py")
    module = importlib.util.module_from_spec(bench)
    bench.loader.exec_module(module)
    model = HypeNetForCausalLM(HypeNetConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=2, num_attention_heads=2,
                                             num_key_value_heads=1, head_dim=8,
                                             mixer_types=["attention", "lightning"]))
    one, four = module.step_bytes(model, 100, 1), module.step_bytes(model, 100, 4)
    assert one["kv_GB"] * 1e9 == 2 * 100 * 1 * 8 * 4 and four["kv_GB"] == 4 * one["kv_GB"]
    assert (four["rnn_state_GB"] * 1e9 == 4 * 2 * 8 * 8 * 4 * 2
            and four["weights_GB"] == one["weights_GB"])
    # --tile: a 5-token prefill's keys/values repeated to 12 tokens, its RNN state kept
    cache = HypeNetCache(2)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4, 5]]), cache=cache, use_cache=True)
    big = module.tiled(cache, 12, room=3)
    k, v = big.layers[0]
    assert big.seen_tokens == 12 and k.shape[1] == 12 and big.layers[1] is cache.layers[1]
    for t in (k, v):
        src = cache.layers[0][t is v]
        assert torch.equal(t[:, 5:10], src) and torch.equal(t[:, 10:], src[:, :2])
    assert big._kv_buffers[0][0].shape[1] == 15  # one buffer: context + room, no doubling


def test_decode_step_time_counts_the_state_writing_step_once_per_period(monkeypatch):
    """profile_decode.timed on a decoder whose states are written every 4 tokens: the step time is
    the median of whole periods' means, so the writing step (one in four, dearer) counts; a median
    of single steps would report a cheap step. With writes every token, the median step."""
    sys.path.insert(0, str(REPO))
    from types import SimpleNamespace

    import bench.profile_decode as pd

    clock = [0.0]
    monkeypatch.setattr(pd.time, "perf_counter", lambda: clock[0])

    def decoder(every: int, cost_ms):
        calls = [0]

        def step(token):
            clock[0] += cost_ms(calls[0]) / 1e3
            calls[0] += 1
        deferred = {3: SimpleNamespace(every=every)} if every > 1 else {}
        return SimpleNamespace(step=step, tokens=torch.zeros(2, 1),
                               cache=SimpleNamespace(deferred=deferred))

    writes = decoder(4, lambda i: 4.0 if i % 4 == 3 else 1.0)  # [1, 1, 1, 4] per period
    assert pd.timed(writes, 17, torch.device("cpu")) == pytest.approx(1.75)
    plain = decoder(1, lambda i: 9.0 if i == 0 else 2.0 + (i % 2))  # first call slow, then 3, 2, ..
    assert pd.timed(plain, 5, torch.device("cpu")) == pytest.approx(2.5)


@pytest.mark.slow
def test_decode_profile_on_a_tiled_prefill_compares_with_the_eager_step(tmp_path):
    """``--tile``: the graph step against the eager one on a cache of real keys repeated past the
    prefilled length (how 2M is checked on the H200)."""
    out = tmp_path / "decode_profile.json"
    res = subprocess.run([sys.executable, str(REPO / "bench" / "profile_decode.py"), "--cpu-smoke",
                          "--prefill", "--tile", "24", "--models", "hypenet-2b", "--variants",
                          "graph", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tile"] == 24 and row["context"] == 64 and row["rel_err_vs_eager"] < 1e-5


def test_decode_ratio_alternates_the_two_models_and_takes_the_median_round_ratio(tmp_path):
    """bench/decode_ratio.py on CPU: both models timed in alternating rounds in one process; the
    speed-up is the median of each round's teacher / HypeNet step, and every round timed both."""
    sys.path.insert(0, str(REPO))
    from bench.decode_ratio import main

    out = main(["--cpu-smoke", "--out", str(tmp_path / "ratio.json")])
    times = out["times_ms"]
    assert [len(t) for t in times.values()] == [3, 3] and all(
        t > 0 for ts in times.values() for t in ts)
    ratios = [a / b for a, b in zip(times["qwen3-1.7b-shape"], times["hypenet-2b"])]
    assert out["round_ratios"] == ratios and out["decode_speedup"] == sorted(ratios)[1]
    student = out["rows"][1]
    assert (student["model"] == "hypenet-2b"
            and out["decode_bytes_bound_ratio"] == student["vs_bound"])
    written = json.loads((tmp_path / "ratio.json").read_text())
    assert written["decode_speedup"] == out["decode_speedup"]


def test_the_bytes_bound_uses_the_cards_bandwidth_or_refuses_an_unknown_card(monkeypatch):
    """The decode benches' bytes bound is computed at the card's own bandwidth (an H100 at the
    H200's 4.4 TB/s would look 1.43x slower than it is); an unknown card needs --bandwidth."""
    sys.path.insert(0, str(REPO))
    from bench import common

    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: True)
    for name, bps in [("NVIDIA H200", 4.4e12), ("NVIDIA H100 80GB HBM3", 3.35e12)]:
        monkeypatch.setattr(common.torch.cuda, "get_device_name", lambda i, n=name: n)
        assert common.decode_bandwidth(None) == bps and common.decode_bandwidth(2e12) == 2e12
    monkeypatch.setattr(common.torch.cuda, "get_device_name", lambda i: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(SystemExit, match="A100.*--bandwidth"):
        common.decode_bandwidth(None)
    assert common.decode_bandwidth(1.9e12) == 1.9e12
