"""Continuous-batching rollouts (``opd/rollouts.py``): greedy rollouts through refilled slots
equal each prompt decoded alone with the dynamic cache (float64, every decode mixer kind), sampled
ones follow the generator and the distribution, and top-p keeps the smallest set reaching p."""

import pytest
import torch

from halo_dist.models.hypenet import HypeNetCache, HypeNetConfig, HypeNetForCausalLM
from halo_dist.opd.rollouts import continuous_rollouts, sample_tokens


def tiny(mixers) -> HypeNetForCausalLM:
    torch.manual_seed(0)
    cfg = HypeNetConfig(vocab_size=97, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=len(mixers), num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, mixer_types=list(mixers))
    return HypeNetForCausalLM(cfg).double().eval()


@torch.no_grad()
def greedy_alone(model, prompt, horizon, eos):
    cache = HypeNetCache(model.config.num_hidden_layers)
    device = next(model.parameters()).device
    logits = model(torch.tensor([prompt], device=device), cache=cache,
                   use_cache=True).logits[:, -1]
    out = []
    for _ in range(horizon):
        tok = int(logits.argmax(-1))
        out.append(tok)
        if tok == eos:
            break
        logits = model(torch.tensor([[tok]], device=device), cache=cache,
                       use_cache=True).logits[:, -1]
    return out


@pytest.mark.parametrize("mixers", [("attention", "lightning", "gdn", "attention"),
                                    ("lightning", "attention")])
def test_refilled_slots_decode_each_prompt_as_it_would_alone(mixers):
    model = tiny(mixers)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7, 4, 8)]
    horizon = 10
    free = [greedy_alone(model, p, horizon, None) for p in prompts]
    # an EOS that ends some rollouts early and not others: slots retire at different steps
    eos = free[0][3]
    want = [greedy_alone(model, p, horizon, eos) for p in prompts]
    assert len({len(w) for w in want}) > 1, want
    # one slot, fewer slots than prompts, one per prompt, more slots than prompts
    for slots in (1, 3, 7, 9):
        got = continuous_rollouts(model, prompts, horizon, slots, temperature=0.0,
                                  eos_token_id=eos)
        assert got == want, slots
    assert continuous_rollouts(model, prompts, horizon, 3, temperature=0.0, eos_token_id=eos,
                               stop_at_eos=False) == free


def test_sampled_rollouts_follow_the_generator_and_stop_at_eos():
    model = tiny(("attention", "lightning"))
    prompts = [[5, 6, 7], [9, 10, 11, 12], [20], [30, 31]]

    def run(seed, **kw):
        return continuous_rollouts(model, prompts, 12, 2, generator=torch.Generator().manual_seed(
            seed), **kw)

    a, b = run(3), run(3)
    assert a == b and all(len(x) == 12 for x in a)
    assert run(4) != a
    eos = a[0][4]
    cut = run(3, eos_token_id=eos)
    assert all(x[-1] == eos and eos not in x[:-1] or (len(x) == 12 and eos not in x) for x in cut)
    assert cut[0] == a[0][:5]


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_tokens(logits, 1.0, 0.7, g)) for _ in range(300)}
    assert draws == {0, 1}
    draws = {int(sample_tokens(logits, 1.0, 1.0, g)) for _ in range(600)}
    assert draws == {0, 1, 2, 3}
    assert int(sample_tokens(logits, 0.0, 1.0, None)) == 0


def test_sampled_tokens_follow_the_distribution_and_its_top_p_cut():
    """The exponential race draws token v with probability p_v (and p_v / sum of the kept set
    under top-p): 40,000 rows of one distribution, frequencies within 0.01 (about 4 standard
    deviations)."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(p).expand(40_000, 4)
    g = torch.Generator().manual_seed(0)
    freq = torch.bincount(sample_tokens(logits, 1.0, 1.0, g), minlength=4) / 40_000
    torch.testing.assert_close(freq, p, atol=0.01, rtol=0)
    freq = torch.bincount(sample_tokens(logits, 1.0, 0.7, g), minlength=4) / 40_000
    torch.testing.assert_close(freq, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.01, rtol=0)
    # temperature 2 flattens: p^(1/2), renormalised
    flat = p.sqrt() / p.sqrt().sum()
    freq = torch.bincount(sample_tokens(logits * 1.0, 2.0, 1.0, g), minlength=4) / 40_000
    torch.testing.assert_close(freq, flat, atol=0.01, rtol=0)


def test_bad_arguments_are_refused():
    model = tiny(("attention", "lightning"))
    with pytest.raises(ValueError, match="empty prompt"):
        continuous_rollouts(model, [[1], []], 4, 2)
    with pytest.raises(ValueError, match="positive"):
        continuous_rollouts(model, [[1]], 4, 0)
    with pytest.raises(ValueError, match=r"horizon \(0\)"):
        continuous_rollouts(model, [[1]], 0, 2)
    assert continuous_rollouts(model, [], 4, 2) == []


@pytest.mark.cuda
def test_refilled_slots_through_the_cuda_graph():
    """fp32 on CUDA: the captured graph (split-KV kernel with per-row lengths, in-place Lightning
    update) through refills gives each prompt's greedy rollout alone."""
    model = tiny(("attention", "lightning", "attention", "lightning")).float().cuda()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (5, 40, 3, 17, 9, 26)]
    free = [greedy_alone(model, p, 16, None) for p in prompts]
    eos = free[1][5]
    want = [greedy_alone(model, p, 16, eos) for p in prompts]
    got = continuous_rollouts(model, prompts, 16, 2, temperature=0.0, eos_token_id=eos)
    assert got == want
