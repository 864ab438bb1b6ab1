"""The decode step's GEMV (``decode_gemv.py``): the Triton kernel against ``F.linear`` (on CPU under
``TRITON_INTERPRET=1``, on CUDA in bf16), the dispatch that keeps it off CPU, training and batched
rollouts, and the static decoder with it against the decoder without it (CUDA, run on the
device)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from halo_dist.models.hypenet import decode_gemv
from halo_dist.models.hypenet.decode_gemv import MAX_ROWS, decode_linear, uses_gemv

CUDA = torch.cuda.is_available()
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not decode_gemv._HAS_TRITON, reason="triton not installed")
def test_gemv_kernel_in_the_interpreter_equals_f_linear():
    """fp32 on CPU: 1-4 rows, sizes that are not multiples of the tiles (masked edges in N and K),
    with and without bias, a strided input row (a view of a wider tensor), every candidate tile."""
    script = textwrap.dedent("""
        import torch
        import torch.nn.functional as F
        from halo_dist.models.hypenet.decode_gemv import CANDIDATES, gemv_triton

        torch.manual_seed(0)
        worst = 0.0
        for M, N, K in ((1, 37, 300), (3, 8, 64), (4, 130, 129)):
            w = torch.randn(N, K)
            b = torch.randn(N)
            x = torch.randn(M, 2 * K)[:, :K]  # rows K apart, unit stride inside a row
            for cfg in CANDIDATES[:4]:
                for bias in (None, b):
                    got = gemv_triton(x[:, None], w, bias, *cfg)  # [M, 1, K] -> [M, 1, N]
                    want = F.linear(x[:, None], w, bias)
                    assert got.shape == want.shape, (got.shape, want.shape)
                    worst = max(worst, float((got - want).norm() / want.norm()))
        print("worst", worst)
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split("worst")[-1]) < 1e-5, out.stdout


def test_decode_linear_is_f_linear_off_cuda_and_for_many_rows():
    torch.manual_seed(0)
    w, b = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    for rows in (1, MAX_ROWS + 1):
        x = torch.randn(rows, 1, 5, dtype=torch.float64)
        assert not uses_gemv(x, w)
        assert torch.equal(decode_linear(x, w, b), F.linear(x, w, b))
    with pytest.raises(ValueError, match="rows"):
        decode_gemv.gemv_triton(torch.randn(MAX_ROWS + 1, 5), torch.randn(6, 5))


@pytest.mark.skipif(not CUDA, reason="CUDA only (the device runs it)")
def test_gemv_kernel_and_tuning_on_cuda():
    """bf16: every candidate against cuBLAS (fp32 accumulation both), the decode shapes of a
    2B model; ``tune_gemv`` keeps one of the candidates and reports both timings."""
    torch.manual_seed(0)
    shapes = ((2048, 2048), (6144 * 2, 2048), (2048, 6144), (4096 + 1024, 2048))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
               for n, k in shapes for _ in range(3)]
    for rows in (1, 3):
        for w in weights[::3]:
            x = torch.randn(rows, 1, w.shape[1], device="cuda", dtype=torch.bfloat16)
            want = F.linear(x.float(), w.float())
            for cfg in decode_gemv.CANDIDATES:
                got = decode_gemv.gemv_triton(x, w, None, *cfg).float()
                assert (got - want).norm() / want.norm() < 1e-2, cfg
    report = decode_gemv.tune_gemv(weights, rows=1)
    assert set(report) == set(shapes)
    for rec in report.values():
        assert rec["config"] in decode_gemv.CANDIDATES and rec["us"] > 0 and rec["cublas_us"] > 0


@pytest.mark.skipif(not CUDA, reason="CUDA only (the device runs it)")
def test_static_decoder_with_gemv_equals_the_one_without():
    """The graph step of a bf16 Lightning/attention model: the same logits (to bf16 rounding)
    through the GEMV as through cuBLAS, over 8 steps fed the same tokens."""
    from halo_dist.models.hypenet import HypeNetCache, HypeNetConfig, HypeNetForCausalLM
    from halo_dist.models.hypenet.static_decode import StaticDecoder

    torch.manual_seed(0)
    cfg = HypeNetConfig(vocab_size=512, hidden_size=256, intermediate_size=768,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, mixer_types=["attention", "lightning", "lightning",
                                                  "attention"])
    model = HypeNetForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(1, 512, (1, 40), device="cuda")
    decoders = []
    for gemv in (True, False):
        cache = HypeNetCache(4, reserve_tokens=16)
        with torch.no_grad():
            token = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        decoders.append(StaticDecoder(model, cache, gemv=gemv))
    with_gemv, without = decoders
    assert with_gemv.graph is not None and without.graph is not None
    assert without.gemv_report == {}
    token = token.argmax(-1)
    for _ in range(8):
        got = with_gemv.step(token).float()
        want = without.step(token).float()
        assert (got - want).norm() / want.norm() < 2e-2
        token = want.argmax(-1)
