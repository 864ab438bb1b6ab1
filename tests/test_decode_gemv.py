"""The batch-1 decode GEMV (``decode_gemv.py``): the kernel against ``F.linear`` in Triton's
interpreter for every candidate tile, a whole static decoder through it against cuBLAS's, the
switches; on CUDA, the per-shape tuning and the compiled graph step."""

import copy

import pytest
import torch
import torch.nn.functional as F

from halo_dist.models.hypenet import HypeNetCache, HypeNetConfig, HypeNetForCausalLM
from halo_dist.models.hypenet import decode_gemv
from halo_dist.models.hypenet.static_decode import DecodeOptions, StaticDecoder
from triton_interp import HAS_TRITON, run_interpreted



@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_gemv_kernel_in_the_interpreter_equals_f_linear_for_every_tile():
    """Every candidate tile on shapes that are not multiples of it (masked rows and chunks), with
    and without a bias, then whole decoders (attention + Lightning, output gates) whose every
    projection goes through the kernel against the same decoders on F.linear, token by token."""
    script = """
        import copy, torch, torch.nn.functional as F
        from halo_dist.models.hypenet import HypeNetCache, HypeNetConfig, HypeNetForCausalLM
        from halo_dist.models.hypenet import decode_gemv
        from halo_dist.models.hypenet.static_decode import DecodeOptions, StaticDecoder

        torch.manual_seed(0)
        worst = 0.0
        for N, K in ((37, 96), (64, 300), (5, 2048)):
            w, b = torch.randn(N, K), torch.randn(N)
            x = torch.randn(1, 1, K)
            for cfg in decode_gemv.CANDIDATES:
                for bias in (None, b):
                    got = decode_gemv.gemv_triton(x, w, bias, *cfg)
                    want = F.linear(x, w, bias)
                    assert got.shape == want.shape, (got.shape, want.shape)
                    worst = max(worst, float((got - want).norm() / want.norm()))
        print("kernel", worst)

        # whole decoders: every shape chosen for the kernel (CPU tensors: the interpreter)
        decode_gemv.kernel_fits = lambda x, w: True
        cfg = HypeNetConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, mixer_types=["attention", "lightning"] * 2,
                            attn_output_gate=True, qkv_bias=True)
        model = HypeNetForCausalLM(cfg).float().eval()
        for layer in model.model.layers:  # every weight shape of the packs, chosen for a tile
            for group in (layer.mixer.input_linears(), layer.mlp.input_linears(),
                          [layer.mixer.o_proj], [layer.mlp.down_proj]):
                n, k = sum(lin.out_features for lin in group), group[0].in_features
                decode_gemv._CHOICE[(n, k, torch.float32, None)] = (4, 32, 4)
        ids = torch.randint(1, 97, (1, 9))
        cache = HypeNetCache(4, reserve_tokens=6)
        with torch.no_grad():
            first = model(ids, cache=cache, use_cache=True).logits[:, -1].argmax(-1)
        calls = []
        real = decode_gemv.gemv_triton
        decode_gemv.gemv_triton = lambda *a, **k: calls.append(a[1].shape) or real(*a, **k)
        gemv = StaticDecoder(model, cache, DecodeOptions(use_cuda_graph=False, gemv=True))
        plain = StaticDecoder(model, copy.deepcopy(cache), DecodeOptions(use_cuda_graph=False,
                                                                         gemv=False))
        nxt, err = first, 0.0
        for _ in range(4):
            a, b = gemv.step(nxt).clone(), plain.step(nxt).clone()
            err = max(err, float((a - b).norm() / b.norm()))
            nxt = b.argmax(-1)
        print("shapes", sorted(set(tuple(s) for s in calls)))
        print("model", err, len(calls))
    """
    out = run_interpreted(script, timeout=600, probe=False)
    kernel = float(out.split("kernel")[-1].split()[0])
    model_err, calls = out.split("model")[-1].split()
    assert kernel < 1e-5, out
    assert float(model_err) < 1e-5, out
    # 4 layers x (packed inputs, output) x (mixer, MLP) per token, 4 tokens
    assert int(calls) == 4 * 4 * 4, out
    assert "(64, 96)" in out and "(64, 64)" in out, out


def test_gemv_applies_only_where_it_was_chosen():
    """The kernel only takes one-row CUDA products in bf16/fp16, and ``decode_linear`` is
    ``F.linear`` wherever no tile was chosen."""
    w, x = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(1, 16, dtype=torch.bfloat16)
    assert not decode_gemv.kernel_fits(x, w)  # CPU
    torch.testing.assert_close(decode_gemv.decode_linear(x, w), F.linear(x, w))
    with pytest.raises(ValueError, match="one row"):
        decode_gemv.gemv_triton(torch.randn(2, 16), torch.randn(8, 16))


@pytest.mark.cuda
def test_gemv_tuning_and_the_graph_step_on_cuda():
    """On the GPU: ``tune_gemv`` chooses per shape between cuBLAS and the candidates (each chosen
    kernel within bf16 rounding of cuBLAS), and a compiled, graphed batch-1 decoder through those
    choices follows the cuBLAS decoder's logits."""
    torch.manual_seed(0)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
          for n, k in ((2048, 2048), (2048, 2048), (6144, 2048), (2048, 6144))]
    decode_gemv._CHOICE.clear()
    report = decode_gemv.tune_gemv(ws)
    assert set(report) == {"2048x2048", "6144x2048", "2048x6144"}, report
    for w in ws:
        x = torch.randn(1, 1, w.shape[1], device="cuda", dtype=torch.bfloat16)
        got, want = decode_gemv.decode_linear(x, w).float(), F.linear(x, w).float()
        assert float((got - want).norm() / want.norm()) < 1e-2
        for cfg in decode_gemv.CANDIDATES:
            got = decode_gemv.gemv_triton(x, w, None, *cfg).float()
            assert float((got - want).norm() / want.norm()) < 1e-2, cfg
    # the kernel inside a compiled, graphed step whatever the timings said: every pack's shape
    # chosen for a tile
    cfg = HypeNetConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, mixer_types=["attention", "lightning"] * 2)
    model = HypeNetForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
    for layer in model.model.layers:
        for group in (layer.mixer.input_linears(), layer.mlp.input_linears(),
                      [layer.mixer.o_proj], [layer.mlp.down_proj]):
            n, k = sum(lin.out_features for lin in group), group[0].in_features
            decode_gemv._CHOICE[(n, k, torch.bfloat16, torch.cuda.current_device())] = (4, 256, 4)
    ids = torch.randint(1, 512, (1, 64), device="cuda")
    cache = HypeNetCache(4, reserve_tokens=16)
    with torch.no_grad():
        first = model(ids, cache=cache, use_cache=True).logits[:, -1].argmax(-1)
    gemv = StaticDecoder(model, cache, DecodeOptions(compile=True, gemv=True))
    plain = StaticDecoder(model, copy.deepcopy(cache), DecodeOptions(compile=True, gemv=False))
    assert gemv.graph is not None and gemv.compile_error is None, gemv.compile_error
    nxt, err = first, 0.0
    for _ in range(6):
        a, b = gemv.step(nxt).float(), plain.step(nxt).float()
        err = max(err, float((a - b).norm() / b.norm()))
        nxt = b.argmax(-1)
    assert err < 5e-2, err
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        gemv.step(nxt)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert sum("_gemv_kernel" in n for n in names) == 4 * 4, names  # 4 per layer
    decode_gemv._CHOICE.clear()
