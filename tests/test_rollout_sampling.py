"""The decode sampler: the Triton Gumbel-max kernel (run by Triton's interpreter on CPU) draws from
softmax(logits / T), splits the vocabulary without changing the winner, and follows the caller's
generator; the dispatcher keeps the torch reference where the kernel does not apply."""

import pytest
import torch

from halo_dist.opd.sampling import (exponential_race_torch,
                                    gumbel_argmax_triton, kernel_applies,
                                    sample_tokens)
from triton_interp import HAS_TRITON, run_interpreted


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_gumbel_kernel_draws_from_the_tempered_softmax_and_keeps_the_argmax_across_splits():
    out = run_interpreted("""
        import torch
        from halo_dist.opd.sampling import gumbel_argmax_triton

        # 1. frequencies over 400 rows of the same logits at T = 0.7 (a T of 1 would be off by
        # more than 0.1 on the first token)
        x = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
        want = torch.softmax(x / 0.7, -1)
        assert (want - torch.softmax(x, -1)).abs().max() > 0.1
        g = torch.Generator().manual_seed(0)
        draws = gumbel_argmax_triton(x.expand(400, 5).contiguous(), 0.7, g, block=16)
        freq = torch.bincount(draws, minlength=5) / 400
        print("freq_err", float((freq - want).abs().max()))

        # 2. a 5,000-token vocabulary in blocks of 256 over 20 programs per row: at T = 1e-3 the
        # draw is the argmax wherever it sits (the second row's in the last, partial block)
        logits = torch.randn(2, 5000, generator=torch.Generator().manual_seed(1))
        logits[0, 2345] += 10.0
        logits[1, 4999] += 10.0
        got = gumbel_argmax_triton(logits, 1e-3, g, block=256)
        print("argmax_ok", got.tolist() == [2345, 4999])

        # 2b. the distribution across splits: 32 tokens in 4 programs of 8 per row
        x = torch.linspace(2.0, -2.0, 32)
        draws = gumbel_argmax_triton(x.expand(200, 32).contiguous(), 1.0, g, block=8,
                                     programs_per_sm=1000)
        mass = (torch.bincount(draws, minlength=32) / 200).view(4, 8).sum(1)
        print("split_mass_err", float((mass - torch.softmax(x, -1).view(4, 8).sum(1)).abs().max()))

        # 3. the caller's generator decides the draws; every (row, token) has its own uniform:
        # 16 equal tokens in 2 blocks of 8 (4 uniforms per Philox call: 2 tokens a quarter),
        # each block its own program. A uniform shared across rows, blocks, programs or a call's
        # quarters makes ties, which the first token wins: some tokens would never be drawn
        flat = torch.zeros(100, 16)
        a, b, c = (gumbel_argmax_triton(flat, 1.0, torch.Generator().manual_seed(seed), block=8,
                                        programs_per_sm=1000) for seed in (5, 5, 6))
        print("same_seed", torch.equal(a, b), "other_seed", not torch.equal(a, c),
              "distinct", len(set(a.tolist())))
    """)
    values = dict(zip(out.split()[::2], out.split()[1::2]))
    # 400 draws: <= 0.025 standard error; a temperature ignored is off by > 0.1
    assert float(values["freq_err"]) < 0.05, out
    assert values["argmax_ok"] == "True", out
    assert float(values["split_mass_err"]) < 0.08, out  # 200 draws: <= 0.035 standard error
    assert values["same_seed"] == "True" and values["other_seed"] == "True", out
    assert int(values["distinct"]) >= 14, out  # 100 draws over 16 equal tokens: all 16 at 97%


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_gumbel_kernel_gives_every_row_and_token_a_uniform_of_its_own():
    """With one token per row left finite, a split's best value is that token's perturbed logit,
    ``-log(-log U)``: read for every token under one seed, the 5 x 12 values are all distinct. A
    uniform shared by two (row, token) pairs (across rows, blocks, programs, or a Philox call's four
    outputs; the last block here is partial) would repeat a value."""
    out = run_interpreted("""
        import torch
        from halo_dist.opd.sampling import gumbel_splits

        B, V = 5, 12  # blocks of 8: one whole, one partial, a program each
        perturbed = torch.empty(B, V)
        for t in range(V):
            logits = torch.full((B, V), -1e4)
            logits[:, t] = 0.0
            val, idx = gumbel_splits(logits, 1.0, torch.Generator().manual_seed(0), block=8,
                                     programs_per_sm=1000)
            assert val.shape == (B, 2) and bool((idx[:, t // 8] == t).all()), (t, idx)
            perturbed[:, t] = val[:, t // 8]
        print("distinct", len(set(perturbed.flatten().tolist())),
              "finite", bool(torch.isfinite(perturbed).all()))
    """)
    assert out.split() == ["distinct", "60", "finite", "True"], out


def test_the_kernel_runs_only_where_it_applies():
    """CUDA, no nucleus cut, keys that fit 31 bits; everything else (CPU logits too) draws through
    the reference, whose draws the same generator state repeats."""
    assert kernel_applies("cuda", 1.0, 1000) == HAS_TRITON  # the kernel is the default
    assert not kernel_applies("cuda", 0.9, 1000)
    assert not kernel_applies("cpu", 1.0, 1000)
    assert not kernel_applies("cuda", 1.0, 2 ** 31)
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    for top_p in (1.0, 0.8):
        got = sample_tokens(logits, 0.9, top_p, torch.Generator().manual_seed(3))
        want = exponential_race_torch(logits, 0.9, top_p, torch.Generator().manual_seed(3))
        assert torch.equal(got, want)
    assert torch.equal(sample_tokens(logits, 0.0, 1.0, None), logits.argmax(-1))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_gumbel_kernel_on_cuda_draws_from_the_softmax():
    """The compiled kernel: frequencies over 100,000 rows; the same generator state repeats the
    draws; at the rollouts' shape (256 x 151,936 bf16, several programs per row) a near-zero
    temperature gives the argmax."""
    x = torch.tensor([1.5, 1.0, 0.2, 0.0, -0.5, -3.0], device="cuda")
    rows = x.expand(100_000, 6).contiguous().bfloat16()
    draws = gumbel_argmax_triton(rows, 1.3, torch.Generator(device="cuda").manual_seed(0))
    again = gumbel_argmax_triton(rows, 1.3, torch.Generator(device="cuda").manual_seed(0))
    assert torch.equal(draws, again)
    freq = torch.bincount(draws, minlength=6).float() / 100_000
    want = torch.softmax(x.bfloat16().float() / 1.3, -1)
    assert (freq - want).abs().max() < 0.01
    logits = torch.randn(256, 151_936, device="cuda", dtype=torch.bfloat16)
    top = torch.randint(0, 151_936, (256,), device="cuda")
    logits[torch.arange(256, device="cuda"), top] = 20.0
    got = gumbel_argmax_triton(logits, 1e-3, torch.Generator(device="cuda").manual_seed(1))
    assert torch.equal(got, top)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_sampler_benchmark_runs_both_samplers(tmp_path):
    """bench/tune_decode_kernels.py --sampler on CPU (Triton's interpreter): both samplers (the
    kernel at two block sizes) at two row counts, timed and written (the device run times them at
    256, 512 and 768 rows)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "tune.json"
    run = subprocess.run([sys.executable, str(repo / "bench" / "tune_decode_kernels.py"),
                          "--sampler", "--cpu-smoke", "--out", str(out)], cwd=repo,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert sorted(cases) == ["sampler b2 vocab 1000", "sampler b4 vocab 1000"]
    for rows in cases.values():
        assert [r["sampler"] for r in rows] == ["torch exponential race", "triton gumbel-max",
                                                "triton gumbel-max, block 1024"]
        assert all(r["ms"] > 0 for r in rows)
