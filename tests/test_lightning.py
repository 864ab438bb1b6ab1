"""The CPU Lightning-attention implementation against a naive per-step recurrence."""

import pytest
import torch

from halo_dist.models.hypenet.ops_rnn import lightning_attention, lightning_log_decay
from halo_dist.models.hypenet.ops_rnn_torch import lightning_chunk_torch, lightning_recurrent_torch


def rand_qkv(B=2, T=50, H=4, D=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, H, D, generator=g, dtype=dtype) for _ in range(3)]


def test_log_decay_matches_spec():
    H = 16
    got = lightning_log_decay(H)
    want = torch.tensor([-(2.0 ** (-8.0 * h / H)) for h in range(1, H + 1)])
    torch.testing.assert_close(got, want.float())
    assert got[-1].item() == pytest.approx(-(2 ** -8))  # slowest head decays by 2^-8 per token


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_equals_naive_recurrence(chunk):
    q, k, v = rand_qkv()
    B, T, H, _ = q.shape
    g = lightning_log_decay(H).double()[None, None].expand(B, T, H)
    init = torch.randn(B, H, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    o_ref, s_ref = lightning_recurrent_torch(q, k, v, g, 0.3, init)
    o, s = lightning_chunk_torch(q, k, v, g, 0.3, init, chunk_size=chunk)
    assert (o - o_ref).abs().max() <= 1e-10
    assert (s - s_ref).abs().max() <= 1e-10


def test_packed_documents_reset_state():
    """One packed row of 3 documents equals each document run alone (state resets at boundaries)."""
    q, k, v = rand_qkv(B=1, T=45, seed=1)
    H = q.shape[2]
    cu = torch.tensor([0, 10, 31, 45], dtype=torch.int32)
    init = torch.randn(3, H, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    g = lightning_log_decay(H).double()[None, None].expand(1, 45, H)
    o, s = lightning_chunk_torch(q, k, v, g, 0.5, init, cu_seqlens=cu, chunk_size=8)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_ref, s_ref = lightning_recurrent_torch(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], 0.5,
                                                 init[n : n + 1])
        assert (o[:, a:b] - o_ref).abs().max() <= 1e-5
        assert (s[n : n + 1] - s_ref).abs().max() <= 1e-10


def test_padding_tokens_are_identity_steps():
    """Left padding leaves the state exactly as if the pads were absent."""
    q, k, v = rand_qkv(B=1, T=20, seed=2, dtype=torch.float32)
    H = q.shape[2]
    decay = lightning_log_decay(H)
    pad = 5
    qp, kp, vp = (torch.cat([torch.randn(1, pad, H, 8), t], dim=1) for t in (q, k, v))
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.bool), torch.ones(1, 20, dtype=torch.bool)],
                     dim=1)
    o_pad, s_pad = lightning_attention(qp, kp, vp, decay, 0.25, token_mask=mask)
    o, s = lightning_attention(q, k, v, decay, 0.25)
    torch.testing.assert_close(o_pad[:, pad:], o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_pad, s, atol=1e-5, rtol=1e-5)


def test_decode_continues_prefill_state():
    q, k, v = rand_qkv(B=2, T=30, seed=3, dtype=torch.float32)
    decay = lightning_log_decay(q.shape[2])
    o_full, s_full = lightning_attention(q, k, v, decay, 0.2)
    o1, s1 = lightning_attention(q[:, :17], k[:, :17], v[:, :17], decay, 0.2)
    outs, s = [o1], s1
    for t in range(17, 30):
        o_t, s = lightning_attention(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], decay, 0.2,
                                     initial_state=s, decode=True)
        outs.append(o_t)
    torch.testing.assert_close(torch.cat(outs, 1), o_full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_full, atol=1e-5, rtol=1e-5)


def test_gradients_match_naive():
    q, k, v = (t.requires_grad_() for t in rand_qkv(B=1, T=24, seed=4))
    H = q.shape[2]
    g = lightning_log_decay(H).double()[None, None].expand(1, 24, H)
    w = torch.randn(1, 24, H, 8, dtype=torch.float64)
    grads = []
    for fn in (lambda: lightning_recurrent_torch(q, k, v, g, 0.3)[0],
               lambda: lightning_chunk_torch(q, k, v, g, 0.3, chunk_size=5)[0]):
        (fn().double() * w).sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= 1e-5


def test_long_chunks_do_not_overflow():
    """exp(G_i - G_j) is formed directly: a 256-token chunk with the fastest head stays finite."""
    q, k, v = rand_qkv(B=1, T=256, H=2, seed=5, dtype=torch.float32)
    g = torch.full((1, 256, 2), -3.0)
    o, s = lightning_chunk_torch(q, k, v, g, 1.0, chunk_size=256)
    o_ref, _ = lightning_recurrent_torch(q, k, v, g, 1.0)
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, o_ref, atol=1e-4, rtol=1e-4)


def test_packed_documents_do_not_recompile_a_compiled_caller():
    """The per-document loop reads the boundaries on the host and runs outside torch.compile: a
    compiled layer (model.compile on CPU) meets a new document layout in every micro-batch, and
    tracing the loop compiled it again for each one (9 recompilations in a 3-step tiny run). Once
    the first change of document count has made the shapes dynamic, nothing compiles again."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()

    def layer(q, k, v, g, cu):
        return lightning_chunk_torch(q, k, v, g, 0.5, None, cu, 4)[0] * 2

    step = torch.compile(layer, backend=counter)
    H, D, T = 2, 4, 16
    frames = []
    for bounds in ([0, 5, 16], [0, 3, 7, 16], [0, 9, 16], [0, 2, 4, 11, 16], [0, 1, 6, 16],
                   [0, 1, 2, 3, 16]):
        q, k, v = (torch.randn(1, T, H, D) for _ in range(3))
        g = -torch.rand(1, T, H)
        cu = torch.tensor(bounds)
        torch.testing.assert_close(step(q, k, v, g, cu), layer(q, k, v, g, cu))
        frames.append(counter.frame_count)
    assert frames[2:] == [frames[1]] * 4, frames
