"""On-policy distillation: loss vs naive, packing, plateau detector, DP reduction, rungs,
a tiny end-to-end run whose held-out reverse KL falls, and bad input."""

import json
import os
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import tiny_qwen3
from distributed import run_distributed
from fault_injection import launcher_args, nan_at
from opd_configs import TINY, VOCAB, tiny_cfg

from halo_dist.config import ConfigError
from halo_dist.models.convert import convert_model
from halo_dist.opd.stage import (HorizonSchedule, OPDModule, PlateauDetector, Rollout,
                                 check_tokenizers, check_vocab, on_policy_step, pack_rollouts,
                                 parameter_groups, position_buckets, sample_rollouts)
from halo_dist.eval.tokenizers import byte_tokenizer
from halo_dist.opd.prompts import Curriculum, PromptError, build_prompt_set
from halo_dist.models.convert import as_exact_hypenet
from halo_dist.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]


def models(attn_layers=(1,), seed=0):
    hf = tiny_qwen3(vocab=VOCAB, seed=seed)
    return hf, convert_model(hf, list(attn_layers)), as_exact_hypenet(hf)


# --------------------------------------------------------------------------------------------- loss
def naive_reverse_kl(student, teacher, rollouts):
    """Per-document full-logit reverse KL(student || teacher) summed over sampled tokens."""
    total = 0.0
    for r in rollouts:
        ids = torch.tensor([r.prompt + r.completion])
        logq = torch.log_softmax(student(ids).logits[0].double(), -1)
        with torch.no_grad():
            logp = torch.log_softmax(teacher(ids).logits[0].double(), -1)
        P = len(r.prompt)
        rows = slice(P - 1, P - 1 + len(r.completion))  # positions predicting the sampled tokens
        total = total + (logq[rows].exp() * (logq[rows] - logp[rows])).sum()
    return total


def test_packing_marks_exactly_the_positions_that_predict_sampled_tokens():
    b = pack_rollouts([Rollout([5, 6, 7], [8, 9]), Rollout([4], []), Rollout([3], [1])])
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 3, 1]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert b.cu_seqlens.tolist() == [0, 5, 7] and b.max_seqlen == 5
    assert b.loss_mask.tolist() == [False, False, True, True, False, True, False]
    assert b.gen_index.tolist() == [-1, -1, 0, 1, -1, 0, -1] and b.num_generated == 3


def test_reverse_kl_loss_and_grads_match_naive_through_the_module():
    _, student, teacher = models()
    torch.manual_seed(0)
    rollouts = [Rollout([7, 8, 9, 10], [11, 12, 13, 1]), Rollout([20, 21], [22, 23, 24, 25, 26]),
                Rollout([30], [31])]
    b = pack_rollouts(rollouts)
    mod = OPDModule(student, teacher, chunk_size=3, buckets=position_buckets(2, 8))
    loss, kl, count, per_bucket = mod(b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen,
                                      b.loss_mask, b.gen_index, normalizer=float(b.num_generated))
    assert int(count) == 10 and sum(int(c) for _, c in per_bucket) == 10
    # gen positions 0-1 (x3 docs less one), 2-3, 4
    assert [int(c) for _, c in per_bucket] == [5, 4, 1]
    loss.backward()
    fused_grads = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
    student.zero_grad()
    ref = naive_reverse_kl(student, teacher, rollouts)
    (ref / 10).backward()
    assert torch.allclose(kl.double(), ref.detach(), rtol=1e-5, atol=1e-7), (kl, ref)
    assert torch.allclose(loss.double(), ref.detach() / 10, rtol=1e-5)
    for n, p in student.named_parameters():
        if p.grad is not None and p.grad.abs().max() > 0:
            assert torch.allclose(fused_grads[n], p.grad, rtol=1e-4, atol=1e-6), n


def naive_jsd(student, teacher, rollouts, beta):
    """Per-document full-logit generalized JSD, beta KL(p || m) + (1 - beta) KL(q || m) with
    m = beta p + (1 - beta) q (p teacher, q student), in float64, summed over sampled tokens."""
    total = 0.0
    for r in rollouts:
        ids = torch.tensor([r.prompt + r.completion])
        q = torch.softmax(student(ids).logits[0].double(), -1)
        with torch.no_grad():
            p = torch.softmax(teacher(ids).logits[0].double(), -1)
        rows = slice(len(r.prompt) - 1, len(r.prompt) - 1 + len(r.completion))
        q, p = q[rows], p[rows]
        m = beta * p + (1 - beta) * q
        total = total + beta * (p * (p / m).log()).sum() + (1 - beta) * (q * (q / m).log()).sum()
    return total


def test_jsd_beta_loss_and_grads_match_naive_through_the_module():
    """opd.beta: the generalized JSD through OPDModule's packed, bucketed, masked fused loss."""
    _, student, teacher = models()
    rollouts = [Rollout([7, 8, 9, 10], [11, 12, 13, 1]), Rollout([20, 21], [22, 23, 24, 25, 26]),
                Rollout([30], [31])]
    b = pack_rollouts(rollouts)
    mod = OPDModule(student, teacher, chunk_size=3, buckets=position_buckets(2, 8), beta=0.3)
    loss, div, count, _ = mod(b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen, b.loss_mask,
                              b.gen_index, normalizer=10.0)
    loss.backward()
    fused_grads = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
    student.zero_grad()
    ref = naive_jsd(student, teacher, rollouts, 0.3)
    (ref / 10).backward()
    assert int(count) == 10
    assert torch.allclose(div.double(), ref.detach(), rtol=1e-5, atol=1e-7), (div, ref)
    for n, p in student.named_parameters():
        if p.grad is not None and p.grad.abs().max() > 0:
            assert torch.allclose(fused_grads[n], p.grad, rtol=1e-4, atol=1e-6), n


def test_sampled_rollouts_are_padding_independent_and_stop_at_eos():
    _, student, _ = models()
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    alone = sample_rollouts(student, [[5, 6, 7]], 12, eos_token_id=None, generator=gen())
    batched = sample_rollouts(student, [[5, 6, 7], [9, 10, 11, 12, 13, 14]], 12, eos_token_id=None,
                              generator=gen())
    assert len(alone[0]) == 12 and len(batched[1]) == 12
    eos = alone[0][4]
    cut = sample_rollouts(student, [[5, 6, 7]], 12, eos_token_id=eos, generator=gen())[0]
    assert cut[-1] == eos and eos not in cut[:-1] and cut == alone[0][: len(cut)]


def test_static_decode_rollouts_sample_the_same_tokens():
    """opd.static_decode: StaticDecoder rollouts (left-padded prompts) = the dynamic loop, token for
    token."""
    _, student, _ = models(attn_layers=(0, 1))
    student = student.double()
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20]]
    gen = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    dynamic = sample_rollouts(student, prompts, 10, eos_token_id=None, generator=gen())
    static = sample_rollouts(student, prompts, 10, eos_token_id=None, generator=gen(),
                             static_cache=True)
    assert static == dynamic and all(len(g) == 10 for g in static)
    # opd.compile_rollouts: the step through torch.compile (float64 on CPU: the same draws)
    compiled = sample_rollouts(student, prompts, 10, eos_token_id=None, generator=gen(),
                               static_cache=True, compile_static=True)
    assert compiled == dynamic
    cfg = tiny_cfg("/tmp/unused", "opd.static_decode=true", "opd.compile_rollouts=true")
    assert cfg.opd.static_decode is True and cfg.opd.compile_rollouts is True


@pytest.mark.slow
def test_bench_opd_cpu_smoke_with_static_rollouts(tmp_path):
    """bench/bench_opd.py end to end on tiny shapes (the device run uses the same code at the 2B
    shape)."""
    out = tmp_path / "opd.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "bench_opd.py"),
                          "--cpu-smoke", "--static-decode", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert rows and all(r["rollout_tokens_per_s"] > 0 and r["train_packed_tokens_per_s"] > 0
                        for r in rows)
    # split by the token budget
    assert [r["micro"] for r in rows] == [64 // (16 + r["horizon"]) for r in rows]


@pytest.mark.slow
def test_bench_opd_times_the_rollouts_set_up_phases(tmp_path):
    """--rollout-phases: the continuous rollouts' prefill and decoder construction, each timed
    alone, and the loop as the rest of the timed call."""
    out = tmp_path / "opd.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "bench_opd.py"), "--cpu-smoke",
                          "--continuous", "--skip-train", "--rollout-phases", "--horizons", "16",
                          "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (row,) = json.loads(out.read_text())["results"]
    assert row["prefill_s"] > 0 and row["decoder_s"] > 0
    assert row["loop_s"] == pytest.approx(row["rollout_s"] - row["prefill_s"] - row["decoder_s"])
    assert row["loop_ms_per_step"] == pytest.approx(row["loop_s"] / 16 * 1e3)
    assert "h16 rollout" in run.stdout and "ms per step" in run.stdout
    # it times continuous rollouts' set-up: refused for generate's batches
    batches = subprocess.run([sys.executable, str(REPO / "bench" / "bench_opd.py"), "--cpu-smoke",
                              "--rollout-phases"], cwd=REPO, capture_output=True, text=True,
                             timeout=300)
    assert batches.returncode == 2 and "needs --continuous" in batches.stderr, \
        batches.stderr[-2000:]


# ------------------------------------------------------------------------------------------ horizon
def test_plateau_detector_fires_on_a_flat_series_not_on_a_falling_one():
    d = PlateauDetector(window=5, patience=2, min_rel_improvement=0.05)
    fired = [d.update(1.0 + 0.001 * (i % 3)) for i in range(30)]
    assert fired.index(True) == 5 * 3 - 1  # best window, then 2 stale windows
    d.reset()
    assert not any(d.update(2.0 * 0.97 ** i) for i in range(200))  # ~14% better every window of 5
    d2 = PlateauDetector(window=2, patience=1, min_rel_improvement=0.1)
    assert not any(d2.update(v) for v in [1.0, 1.0, 0.8, 0.8])  # 20% better
    assert d2.update(0.79) is False and d2.update(0.79) is True  # 1.25% better < 10%
    assert not d2.update(float("nan"))
    d3 = PlateauDetector(**{k: v for k, v in d2.state_dict().items() if not k.startswith("_")})
    d3.load_state_dict(d2.state_dict())
    assert d3.state_dict() == d2.state_dict()


def test_horizon_doubles_on_plateau_respects_min_steps_and_caps():
    h = HorizonSchedule(512, 2048, PlateauDetector(window=2, patience=1, min_rel_improvement=0.01),
                        min_steps=6)
    steps = [s for s in range(1, 40) if h.update(s, 1.0)]
    assert [hz for _, hz in h.history] == [1024, 2048] and h.horizon == 2048
    # flat series, but no doubling sooner than min_steps
    assert steps[0] == 6 and steps[1] - steps[0] >= 6
    assert not h.update(100, 1.0)  # capped


# ---------------------------------------------------------------------------------- groups, prompts
def test_parameter_groups_freeze_attention_and_carry_their_lrs():
    _, student, _ = models(attn_layers=(1, 3))
    groups = parameter_groups(student, lr=1e-3, rnn_lr=2e-3, attn_lr=5e-4, train_attention=True)
    by = {g["name"]: g for g in groups}
    assert by["rnn"]["lr"] == 2e-3 and by["attn"]["lr"] == 5e-4 and by["other"]["lr"] == 1e-3
    n_attn = len(by["attn"]["params"])
    groups = parameter_groups(student, lr=1e-3, train_attention=False)
    assert {g["name"] for g in groups} == {"rnn", "other"}
    frozen = [n for n, p in student.named_parameters() if not p.requires_grad]
    assert len(frozen) == n_attn and all(".mixer." in n and n.split(".")[2] in ("1", "3")
                                         for n in frozen)


def test_curriculum_switches_sets_in_by_horizon_and_step(tmp_path):
    cfg = tiny_cfg(tmp_path, set0=dict(heldout=0))
    # wiki switches in at horizon 32 (tiny.yaml); add a step-gated jsonl set by hand
    jl = tmp_path / "p.jsonl"
    jl.write_text("\n".join(json.dumps({"q": f"What is {i} + {i}?"}) for i in range(10)))
    from halo_dist.config.schema import PromptSetConfig

    sets = list(cfg.opd.prompt_sets) + [PromptSetConfig(name="math", kind="jsonl", path=str(jl),
                                                        text_field="q", start_step=5, weight=100.0)]
    cur = Curriculum(replace(cfg.opd, prompt_sets=sets), byte_tokenizer(), VOCAB)
    assert [s.name for s in cur.active(0, 16)] == ["synthetic"]
    assert [s.name for s in cur.active(0, 32)] == ["synthetic", "wiki"]
    assert [s.name for s in cur.active(5, 16)] == ["synthetic", "math"]
    picks = [name for name, _ in cur.sample(50, 5, 16)]
    assert picks.count("math") > 40
    state = cur.state_dict()
    a = cur.sample(5, 5, 16)
    cur.load_state_dict(state)
    assert cur.sample(5, 5, 16) == a


# ------------------------------------------------------------------------------------- DP reduction
def _one_step_on(batches, world, root):
    """One OPD step of the tiny run whose micro-batches are ``batches`` (rank r takes every world-th
    one): global batch 2 x micro 1, so 1 rank accumulates both and 2 ranks take one each. Returns
    the step's gradient norm and the student's weights after it."""
    import torch.distributed as dist

    from halo_dist.opd.trainer import OPDTrainer

    torch.set_num_threads(1)
    cfg = tiny_cfg(root / f"w{world}", "schedule.total_steps=1",
                   "schedule.warmup_steps=0", "schedule.decay_steps=1", "opd.eval_every=0",
                   "opd.snapshot_every=0", "checkpoint.every_steps=0", "data.global_batch_size=2",
                   "data.micro_batch_size=1", set0=dict(heldout=0))
    t = OPDTrainer(cfg, hf_teacher=tiny_qwen3(vocab=VOCAB), tokenizer=byte_tokenizer()).setup()
    mine = [b.to(t.device) for b in batches[dist.get_rank()::world]]
    t._micro_batches = lambda horizon, on_policy: (mine, 0.0)
    out = t.train_step()
    return (out["grad_norm"],
            {k: v.detach().clone() for k, v in t.module.student.state_dict().items()})


@pytest.mark.slow
def test_token_weighted_reduction_two_ranks_equals_one(tmp_path):
    """Rank 0 gets 4 sampled tokens, rank 1 gets 2: a per-rank mean would weigh them differently.
    The DeepSpeed engine's accumulation and DP average with our normaliser give the same step either
    way."""
    batches = [pack_rollouts([Rollout([5, 6], [7, 8, 9, 10])]),
               pack_rollouts([Rollout([15, 16, 17], [18, 19])])]
    norm1, w1 = _one_step_on(batches, 1, tmp_path)
    two = run_distributed(_one_step_on, world_size=2, args=(batches, 2, tmp_path))
    (norm_a, wa), (norm_b, wb) = two
    assert norm_a == norm_b and norm1 == pytest.approx(norm_a, rel=1e-5) and norm1 > 0
    for k in w1:
        assert torch.equal(wa[k], wb[k]) and torch.allclose(w1[k], wa[k], rtol=1e-5, atol=1e-6), k


# --------------------------------------------------------------------------------------------- runs
def run_trainer(cfg, hf=None, student=None):
    from halo_dist.opd.trainer import OPDTrainer

    hf = hf if hf is not None else tiny_qwen3(vocab=VOCAB)
    t = OPDTrainer(cfg, hf_teacher=hf, student=student, tokenizer=byte_tokenizer()).setup()
    t.train()
    t.finish()
    return t


@pytest.mark.slow
def test_tiny_run_heldout_reverse_kl_falls(tmp_path):
    """Random tiny Qwen3 teacher, student = its conversion with 3 of 4 layers Lightning (no stage
    1)."""
    cfg = tiny_cfg(tmp_path, "schedule.total_steps=24", "schedule.decay_steps=6",
                   "opd.eval_every=0", "data.global_batch_size=8", "data.micro_batch_size=4",
                   "opd.plateau_window=3", "optim.lr=2e-3", "checkpoint.every_steps=0",
                   "opd.snapshot_every=0", set0=dict(heldout=12, num_prompts=200))
    t = run_trainer(cfg)
    (s0, first), (s1, last) = t.eval_history[0], t.eval_history[-1]
    assert s0 == 0 and s1 == 24 and last < 0.75 * first, t.eval_history
    m = read_metrics(tmp_path)
    assert m["progress/horizon"][0][1] == 16
    assert "train/kl_pos_00000_00008" in m and "perf/rollout_tokens_per_s_per_gpu" in m
    assert (tmp_path / "final" / "config.json").exists()
    record = json.loads((tmp_path / "final" / "halo_dist.json").read_text())
    assert (record["stage"] == "opd" and record["step"] == 24
            and record["tokens"] == t.tokens_seen > 0)
    assert record["eval"]["eval/reverse_kl"] == last


@pytest.mark.slow
def test_compiled_layers_and_rollouts_train_like_the_eager_run(tmp_path):
    """model.compile=layer (training forwards of student and teacher compiled, rollouts eager): the
    same sampled tokens and, to float rounding, the same losses as the eager run
    (opd.compile_rollouts: test_static_decode_rollouts_sample_the_same_tokens)."""
    common = ("schedule.total_steps=3", "schedule.decay_steps=1", "opd.eval_every=0",
              "data.global_batch_size=4", "data.micro_batch_size=2", "checkpoint.every_steps=0",
              "opd.snapshot_every=0")
    eager = run_trainer(tiny_cfg(tmp_path / "eager", *common))
    compiled = run_trainer(tiny_cfg(tmp_path / "compiled", *common, "model.compile=layer"))
    assert eager.tokens_seen == compiled.tokens_seen > 0
    want, got = (read_metrics(tmp_path / name)["train/loss"] for name in ("eager", "compiled"))
    assert [s for s, _ in got] == [s for s, _ in want] == [1, 2, 3]
    for (_, a), (_, b) in zip(got, want):
        assert math.isclose(a, b, rel_tol=1e-4), (got, want)


def test_continuous_batching_trains_and_is_a_function_of_the_seed(tmp_path):
    """opd.continuous_batching: rollouts through refilled slots (opd/rollouts.py); two runs
    of the same config train identically, and the rollouts follow the generator the checkpoints
    keep."""
    common = ("schedule.total_steps=3", "schedule.decay_steps=1", "opd.eval_every=0",
              "data.global_batch_size=4", "data.micro_batch_size=2", "checkpoint.every_steps=0",
              "opd.snapshot_every=0", "opd.continuous_batching=true")
    a = run_trainer(tiny_cfg(tmp_path / "a", *common))
    b = run_trainer(tiny_cfg(tmp_path / "b", *common))
    assert a.cfg.opd.compile_rollouts and not a._compile_rollouts  # compiled on CUDA only
    assert a.tokens_seen == b.tokens_seen > 0
    la, lb = (read_metrics(tmp_path / name)["train/loss"] for name in ("a", "b"))
    assert la == lb and len(la) == 3 and all(math.isfinite(v) for _, v in la)


@pytest.mark.parametrize("name,every", [("bfloat16", 1), ("float32", 3)])
def test_narrow_rollout_states_train_and_are_refused_where_they_cannot_run(tmp_path, monkeypatch,
                                                                          name, every):
    """opd.rollout_state_dtype=bfloat16, opd.rollout_state_write_every=3: rollouts decode with
    Lightning states kept that way (writes deferred: held tokens' slots) and the run trains (finite
    losses); a student with another RNN mixer, and a dtype that is not offered (float24: removed),
    are refused before anything runs."""
    from types import SimpleNamespace

    import halo_dist.opd.rollouts as rollouts_mod
    from halo_dist.config.coerce import ConfigError
    from halo_dist.opd.stage import rollout_decoder_options

    kept = {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]

    seen, held = set(), set()

    class Recording(rollouts_mod.StaticDecoder):
        def step(self, tokens):
            seen.update(s.dtype for s in self.cache.rnn_states())
            held.update(d.every for d in self.cache.deferred.values())
            return super().step(tokens)

    monkeypatch.setattr(rollouts_mod, "StaticDecoder", Recording)

    common = ("schedule.total_steps=3", "schedule.decay_steps=1", "opd.eval_every=0",
              "data.global_batch_size=4", "data.micro_batch_size=2", "checkpoint.every_steps=0",
              "opd.snapshot_every=0", f"opd.rollout_state_dtype={name}",
              f"opd.rollout_state_write_every={every}")
    t = run_trainer(tiny_cfg(tmp_path, *common))
    assert t.tokens_seen > 0
    assert (t.rollout_decoder_options.state_dtype or torch.float32) == kept
    assert t.rollout_decoder_options.state_write_every == every
    assert seen == {kept} and held == ({every} if every > 1 else set())
    assert all(math.isfinite(v) for _, v in read_metrics(tmp_path)["train/loss"])
    with pytest.raises(ConfigError, match="all Lightning"):
        rollout_decoder_options(t.cfg.opd, SimpleNamespace(mixer_types=["attention", "gdn"]))
    for bad in ("float16", "float24"):
        with pytest.raises(ConfigError, match="rollout_state_dtype"):
            tiny_cfg(tmp_path, f"opd.rollout_state_dtype={bad}")


@pytest.mark.slow
def test_rung_continuation_reproduces_the_longer_run(tmp_path):
    """A (12 steps, WSD decay 4) -> pre-decay snapshot at step 8 -> B continues to 16 steps == C run
    16 from scratch."""
    common = ["opd.eval_every=0", "opd.snapshot_every=0", "checkpoint.every_steps=0",
              "schedule.decay_steps=4",
              "opd.horizon_start=8", "opd.horizon_max=16", "opd.plateau_window=1",
              # the horizon doubles on the way
              "opd.plateau_patience=1", "opd.plateau_min_rel_improvement=0.5"]
    a = run_trainer(tiny_cfg(tmp_path / "a", "schedule.total_steps=12", *common,
                             set0=dict(heldout=0)))
    snap = tmp_path / "a" / "snapshots" / "step-00000008"
    assert (snap / "COMPLETE").exists() and a.schedule.decay_start == 8
    b = run_trainer(tiny_cfg(tmp_path / "b", "schedule.total_steps=16", f"opd.resume_from={snap}",
                             *common, set0=dict(heldout=0)))
    c = run_trainer(tiny_cfg(tmp_path / "c", "schedule.total_steps=16", *common,
                             set0=dict(heldout=0)))
    assert c.horizon.history and b.horizon.history == c.horizon.history
    lr_a, lr_b, lr_c = (dict(read_metrics(tmp_path / x)["optim/lr"]) for x in "abc")
    assert all(lr_a[s] == lr_c[s] for s in range(1, 9)) and lr_a[12] < lr_c[12]
    assert all(lr_b[s] == lr_c[s] for s in range(9, 17))
    for (n, pb), (_, pc) in zip(b.module.student.named_parameters(),
                                c.module.student.named_parameters()):
        assert torch.equal(pb, pc), n
    # a snapshot after the decay started cannot start a rung
    late = a.save(tmp_path / "late")
    with pytest.raises(ValueError, match="after its schedule's decay started"):
        run_trainer(tiny_cfg(tmp_path / "d", "schedule.total_steps=20", f"opd.resume_from={late}",
                             *common, set0=dict(heldout=0)))


# -------------------------------------------------------------------------------------------- lmbda
def test_on_policy_steps_are_a_function_of_seed_and_step():
    steps = range(2000)
    half = [on_policy_step(0, s, 0.5) for s in steps]
    # no hidden state: a resume repeats them
    assert half == [on_policy_step(0, s, 0.5) for s in steps]
    assert 900 < sum(half) < 1100 and half != [on_policy_step(1, s, 0.5) for s in steps]
    assert 250 < sum(on_policy_step(0, s, 0.15) for s in steps) < 350
    assert all(on_policy_step(0, s, 1.0) for s in steps) and not any(on_policy_step(0, s, 0.0)
                                                                     for s in steps)
    # the same draw per step: a larger lmbda keeps every on-policy step of a smaller one
    assert all(on_policy_step(0, s, 0.7) for s in steps if on_policy_step(0, s, 0.5))


def test_fixed_continuations_are_the_datasets_and_leave_the_prompts_alone(tmp_path):
    from halo_dist.config.schema import PromptSetConfig

    tok = byte_tokenizer()
    eos = tok.eos_token_id
    docs = tmp_path / "docs.txt"
    docs.write_text("the quick brown fox jumps over the lazy dog\n\nshort doc here\n\n" + "x" * 80)
    text = PromptSetConfig(name="t", kind="text_file", path=str(docs), prompt_tokens=[5, 9],
                           num_prompts=3)
    plain = build_prompt_set(text, tok, VOCAB, seed=3)
    fixed = build_prompt_set(text, tok, VOCAB, seed=3, continuation_tokens=20, eos_token_id=eos)
    assert fixed.train == plain.train and plain.continuations is None
    for doc, p, c in zip(docs.read_text().split("\n\n"), fixed.train, fixed.continuations):
        ids = tok(doc)["input_ids"]
        rest = ids[len(p):]
        assert ids[:len(p)] == p
        # EOS only where the document ends
        assert list(c) == (rest + [eos] if len(rest) < 20 else rest[:20])
    jl = tmp_path / "qa.jsonl"
    jl.write_text("\n".join(json.dumps({"q": f"{i}+{i}=", "a": str(2 * i)}) for i in range(6)))
    qa = build_prompt_set(PromptSetConfig(name="qa", kind="jsonl", path=str(jl),
                                          text_field="q", completion_field="a", heldout=2),
                          tok, VOCAB, continuation_tokens=4, eos_token_id=eos)
    assert len(qa.continuations) == 4 and list(qa.continuations[3]) == tok("6")["input_ids"] + [eos]
    syn = PromptSetConfig(name="s", kind="synthetic", prompt_tokens=[4, 6], num_prompts=5)
    a, b = build_prompt_set(syn, tok, VOCAB), build_prompt_set(syn, tok, VOCAB,
                                                               continuation_tokens=7)
    assert a.train == b.train and all(len(c) == 7 and min(c) >= 4 for c in b.continuations)
    # sampling: the horizon cuts the continuation; the curriculum's RNG state round-trips as before
    cfg = tiny_cfg(tmp_path, "opd.lmbda=0.5")
    cur = Curriculum(cfg.opd, tok, VOCAB, eos_token_id=eos)
    state = cur.state_dict()
    picks = cur.sample_fixed(6, 0, 16)
    s = cur.sets["synthetic"]
    assert all(name == "synthetic" and len(c) == 16 for name, _, c in picks)
    assert all(list(s.continuations[s.train.index(p)][:16]) == c for _, p, c in picks)
    cur.load_state_dict(state)
    assert cur.sample_fixed(6, 0, 16) == picks
    bare = Curriculum(cfg.opd, tok, VOCAB, prebuilt={"synthetic": a})
    with pytest.raises(PromptError, match="'s' has no fixed continuations"):
        bare.sample_fixed(2, 0, 16)


def test_full_horizon_fixed_steps_draw_the_on_policy_prompts_and_fill_the_horizon(tmp_path):
    """opd.fixed_full_horizon: a fixed-data step draws the prompts an on-policy run samples (same
    RNG calls when every continuation fills the horizon) and trains exactly the horizon's tokens of
    each; shorter continuations are skipped, and none long enough is an error."""
    from halo_dist.config.schema import PromptSetConfig

    tok = byte_tokenizer()
    on = Curriculum(tiny_cfg(tmp_path, "opd.lmbda=1").opd, tok, VOCAB)
    cfg = tiny_cfg(tmp_path, "opd.lmbda=0", "opd.fixed_full_horizon=true")
    control = Curriculum(cfg.opd, tok, VOCAB, eos_token_id=tok.eos_token_id)
    for step in range(3):
        picks, fixed = on.sample(4, step, 16), control.sample_fixed(4, step, 16)
        assert [(n, p) for n, p, _ in fixed] == picks
        assert [len(c) for _, _, c in fixed] == [16] * 4
    docs = tmp_path / "docs.txt"
    docs.write_text("\n\n".join(["a" * 12, "b" * 40, "c" * 14, "d" * 60]))
    text = PromptSetConfig(name="t", kind="text_file", path=str(docs), prompt_tokens=[8, 8],
                           num_prompts=4)
    built = build_prompt_set(text, tok, VOCAB, continuation_tokens=32,
                             eos_token_id=tok.eos_token_id)
    assert sorted(len(c) for c in built.continuations) == [5, 7, 32, 32]  # rest + EOS, or the cap
    text_cfg = tiny_cfg(tmp_path, "opd.lmbda=0", set0=dict(kind="text_file", path=str(docs)))
    plain = Curriculum(text_cfg.opd, tok, VOCAB, prebuilt={"synthetic": built})
    assert {len(c) for _, _, c in plain.sample_fixed(40, 0, 16)} == {5, 7, 16}
    full = Curriculum(replace(text_cfg.opd, fixed_full_horizon=True), tok, VOCAB,
                      prebuilt={"synthetic": built})
    picks = full.sample_fixed(40, 0, 16)
    assert {len(c) for _, _, c in picks} == {16} and {p[0] for _, p, _ in picks} == {98, 100}
    with pytest.raises(PromptError, match="no fixed continuation has the 48 tokens of the horizon"):
        full.sample_fixed(2, 0, 48)
    with pytest.raises(ConfigError, match="opd.fixed_full_horizon: applies to fixed-data steps"):
        tiny_cfg(tmp_path, "opd.fixed_full_horizon=true")


def test_an_on_policy_run_and_its_teacher_forced_control_train_as_many_tokens(tmp_path):
    """The control of bench/real/opd_arm.py on the tiny run: rollouts that do not stop at EOS
    against fixed continuations that fill the horizon (opd.fixed_full_horizon) train exactly
    steps x rollouts x horizon tokens each, on the same prompts step by step."""
    from halo_dist.opd.trainer import OPDTrainer

    common = ["schedule.total_steps=3", "schedule.warmup_steps=1", "schedule.decay_steps=1",
              "opd.eval_every=0", "opd.snapshot_every=0",
              "checkpoint.every_steps=0", "opd.stop_at_eos=false", "opd.seed=2"]
    arms = {"opd": ["opd.lmbda=1"], "control": ["opd.lmbda=0", "opd.fixed_full_horizon=true"]}
    trained = {}
    for name, overrides in arms.items():
        cfg = tiny_cfg(tmp_path / name, *common, *overrides, set0=dict(heldout=4))
        t = OPDTrainer(cfg, hf_teacher=tiny_qwen3(vocab=VOCAB), tokenizer=byte_tokenizer()).setup()
        docs = []
        gen, fix = t._rollouts, t._fixed_data
        t._rollouts = lambda n, h: (docs.append(gen(n, h)[0]), (docs[-1], 0.0))[1]
        t._fixed_data = lambda n, h: (docs.append(fix(n, h)), docs[-1])[1]
        t.train()
        trained[name] = (t.tokens_seen, [[(r.prompt, len(r.completion)) for r in step]
                                         for step in docs])
    assert trained["opd"] == trained["control"]
    assert trained["opd"][0] == 3 * 4 * 16 and len(trained["opd"][1]) == 3


def _record_steps(trainer):
    """Which steps sampled rollouts and what each fixed-data step trained on."""
    kinds, fixed = [], []
    gen, fix = trainer._rollouts, trainer._fixed_data
    trainer._rollouts = lambda n, h: (kinds.append((trainer.step, True)), gen(n, h))[1]
    trainer._fixed_data = lambda n, h: (kinds.append((trainer.step, False)),
                                        fixed.append(fix(n, h)), fixed[-1])[2]
    return kinds, fixed


def test_gkd_run_mixes_fixed_and_on_policy_steps_and_resumes_exactly(tmp_path):
    """beta 0.5 and lmbda 0.5 on the tiny run: the on-policy steps are on_policy_step's, fixed-data
    steps train on the synthetic set's continuations, metrics say jsd, and a resume from step 4 ends
    bitwise equal to the uninterrupted run (same choices, same rollouts)."""
    import shutil

    from halo_dist.opd.trainer import OPDTrainer

    common = ["schedule.total_steps=8", "schedule.decay_steps=2", "opd.eval_every=0",
              "opd.snapshot_every=0", "checkpoint.every_steps=4", "opd.lmbda=0.5", "opd.beta=0.5",
              "loss.objective=jsd", "opd.seed=1"]
    runs = {}
    for name in ("full", "resumed"):
        if name == "resumed":
            shutil.copytree(tmp_path / "full" / "checkpoints" / "step-00000004",
                            tmp_path / name / "checkpoints" / "step-00000004")
        cfg = tiny_cfg(tmp_path / name, *common, "checkpoint.resume=auto", set0=dict(heldout=4))
        t = OPDTrainer(cfg, hf_teacher=tiny_qwen3(vocab=VOCAB), tokenizer=byte_tokenizer()).setup()
        kinds, fixed = _record_steps(t)
        t.train()
        runs[name] = (t, kinds, fixed)
    full, kinds, fixed = runs["full"]
    assert kinds == [(s, on_policy_step(1, s, 0.5)) for s in range(8)]
    assert {k for _, k in kinds} == {True, False}
    syn = full.curriculum.sets["synthetic"]
    for batch in fixed:
        for r in batch:
            i = syn.train.index(r.prompt)
            assert r.source == "synthetic" and r.completion == list(syn.continuations[i][:16])
    resumed, rkinds, _ = runs["resumed"]
    assert rkinds == kinds[4:]
    for (n, a), (_, b) in zip(full.module.student.named_parameters(),
                              resumed.module.student.named_parameters()):
        assert torch.equal(a, b), n
    m = read_metrics(tmp_path / "full")
    assert "train/jsd" in m and "eval/jsd" in m and "train/reverse_kl" not in m
    assert [v for _, v in m["progress/on_policy"]] == [float(k) for _, k in kinds]
    assert len(m["perf/rollout_time_s"]) == sum(k for _, k in kinds)


def test_gkd_options_are_checked_up_front(tmp_path):
    from halo_dist.config.schema import PromptSetConfig

    with pytest.raises(ConfigError, match="opd.beta: 0.5 with loss.objective=reverse_kl"):
        tiny_cfg(tmp_path, "opd.beta=0.5")
    for key in ("beta", "lmbda"):
        with pytest.raises(ConfigError, match=rf"opd.{key}: must be in \[0, 1\], got 1.5"):
            tiny_cfg(tmp_path, f"opd.{key}=1.5", "loss.objective=jsd")
    with pytest.raises(ConfigError, match=r"jsonl set\(s\) \['qa'\] have no completion_field"):
        tiny_cfg(tmp_path, "opd.lmbda=0.5",
                 "opd.prompt_sets=[{name: qa, kind: jsonl, path: x.jsonl}]")
    with pytest.raises(ConfigError, match="completion_field: only jsonl sets have one"):
        PromptSetConfig(name="w", kind="wiki", completion_field="a")
    with pytest.raises(ConfigError, match="stage3 trains with kl|ce, not jsd"):
        tiny_cfg(tmp_path, "stage.name=stage3", "loss.objective=jsd", "opd=null")
    assert tiny_cfg(tmp_path, "opd.beta=0.0", "loss.objective=jsd", "opd.lmbda=0").opd.beta == 0.0


# ---------------------------------------------------------------------------------------- bad input
def test_bad_prompt_sets_have_clear_errors(tmp_path):
    opd = tiny_cfg(tmp_path).opd
    from halo_dist.config.schema import PromptSetConfig

    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(PromptError, match="'e' .*is empty"):
        build_prompt_set(PromptSetConfig(name="e", kind="text_file", path=str(empty)),
                         byte_tokenizer(), VOCAB)
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "x" * 200}) + "\n")
    s = build_prompt_set(PromptSetConfig(name="long", kind="jsonl", path=str(long)),
                         byte_tokenizer(), VOCAB)
    with pytest.raises(PromptError,
                       match="200 tokens, longer than the 112 tokens left .* horizon 16"):
        Curriculum(opd, byte_tokenizer(), VOCAB, prebuilt={"synthetic": s}).active(0, 16)
    with pytest.raises(PromptError, match="max_prompt_tokens=50"):
        build_prompt_set(PromptSetConfig(name="l", kind="jsonl", path=str(long),
                                         max_prompt_tokens=50), byte_tokenizer(), VOCAB)
    with pytest.raises(PromptError, match="outside the model vocabulary"):
        build_prompt_set(PromptSetConfig(name="v", kind="jsonl", path=str(long)), byte_tokenizer(),
                         100)
    with pytest.raises(ConfigError, match="prompt_sets: empty"):
        tiny_cfg(tmp_path, "opd.prompt_sets=[]")
    with pytest.raises(ConfigError, match="opd: set exactly when"):
        tiny_cfg(tmp_path, "stage.name=stage3", "loss.objective=kl")
    with pytest.raises(ConfigError, match="horizon_max"):
        tiny_cfg(tmp_path, "opd.horizon_max=8")


def test_tokenizer_and_vocab_mismatch_are_refused():
    _, student, teacher = models()
    other = convert_model(tiny_qwen3(vocab=256), [1])
    with pytest.raises(ValueError, match="student vocabulary 256 != teacher vocabulary 320"):
        check_vocab(other, teacher)

    bigger = byte_tokenizer()
    bigger.add_tokens([f"<extra{i}>" for i in range(400 - len(bigger))])
    with pytest.raises(ValueError,
                       match="tokenizer has 400 tokens but the models' vocabulary is 320"):
        check_vocab(student, teacher, bigger)
    with pytest.raises(ValueError, match="teacher and student tokenizers differ"):
        check_tokenizers(byte_tokenizer(), bigger)
    check_tokenizers(byte_tokenizer(), byte_tokenizer())


def test_the_bundled_teacher_name_gives_its_tokenizer(tmp_path, monkeypatch):
    """model.teacher: smollm2 (the demo configs' teacher) names the bundled teacher's folder for
    the tokenizer too, not a hub id (offline, a hub lookup fails)."""
    from halo_dist import teacher as assets
    from halo_dist.opd.build import load_tokenizer

    byte_tokenizer().save_pretrained(tmp_path / "smollm2")
    monkeypatch.setattr(assets, "smollm2_teacher_dir", lambda: tmp_path / "smollm2")
    cfg = tiny_cfg(tmp_path, "model.teacher=smollm2", "model.random_teacher=null",
                   "opd.tokenizer=null")
    assert load_tokenizer(cfg).get_vocab() == byte_tokenizer().get_vocab()


@pytest.mark.slow
def test_launcher_reports_bad_input_in_one_line(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                            "MASTER_ADDR",
                                                            # in-process runs set these
                                                            "MASTER_PORT")}
    res = subprocess.run([sys.executable, str(REPO / "launchers" / "opd.py"), "--config", str(TINY),
                          f"logging.run_dir={tmp_path}", "opd.max_seq_len=40", "opd.horizon_max=32",
                          "opd.prompt_sets=[{name: s, kind: synthetic, prompt_tokens: [30, 30]}]"],
                         capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**env, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 2, res.stderr[-2000:]
    assert "error: prompt set 's' has a prompt of 30 tokens" in res.stderr


# ------------------------------------------------------------------------------------- stop signals
def run_opd_launcher(run_dir, *overrides, faults=None, expect=0):
    """``launchers/opd.py`` on configs/opd/tiny.yaml in a subprocess; ``faults``: as
    tests/stage_runs.py's ``run_launcher`` (the launcher then runs through
    tests/fault_injection.py)."""
    script = [str(REPO / "launchers" / "opd.py")]
    if faults:
        script = [str(REPO / "tests" / "fault_injection.py"), *launcher_args(**faults), *script]
    # in-process runs set these
    rendezvous = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    cmd = [sys.executable, *script, "--config", str(TINY), f"logging.run_dir={run_dir}",
           "logging.tensorboard=false", "logging.log_every=1", *overrides]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**env, "OMP_NUM_THREADS": "1"})
    assert (res.returncode
            == expect), f"exit {res.returncode}:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    return res


def _final_weights(run_dir):
    from safetensors.torch import load_file

    files = sorted((run_dir / "final").glob("*.safetensors"))
    assert files, list((run_dir / "final").iterdir())
    return {k: v for f in files for k, v in load_file(f).items()}


@pytest.mark.slow
def test_sigterm_checkpoints_exits_0_and_the_restarted_run_ends_bitwise_equal(tmp_path):
    """SIGTERM after step 3 of 6: the launcher checkpoints step 3 and exits 0 without writing
    final/; the restarted launcher resumes there and ends with the uninterrupted run's weights, bit
    for bit, and the same held-out and training curves (the horizon doubles on the way, so the
    detector state resumes too)."""
    common = ["schedule.total_steps=6", "schedule.decay_steps=2", "checkpoint.every_steps=0",
              "opd.snapshot_every=0", "opd.eval_every=2", "opd.plateau_window=1",
              "opd.plateau_patience=1", "opd.plateau_min_rel_improvement=0.5"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_opd_launcher(straight, *common)
    res = run_opd_launcher(stopped, *common, faults=dict(sigterm_at=3))
    assert "stopped by signal" in res.stderr and "at step 3" in res.stderr
    assert [p.name for p in (stopped / "checkpoints").glob("step-*")] == ["step-00000003"]
    assert ((stopped / "checkpoints" / "step-00000003" / "COMPLETE").exists()
            and not (stopped / "final").exists())
    res = run_opd_launcher(stopped, *common)
    assert "resumed from" in res.stdout and "at step 3" in res.stdout
    a, b = _final_weights(straight), _final_weights(stopped)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ma, mb = read_metrics(straight), read_metrics(stopped)
    assert ([s for s, _ in mb["eval/reverse_kl"]] == [0, 2, 4, 6]
            and mb["eval/reverse_kl"] == ma["eval/reverse_kl"])
    assert mb["train/loss"] == ma["train/loss"] and len(ma["train/loss"]) == 6
    assert ma["progress/horizon"] == mb["progress/horizon"] and ma["progress/horizon"][-1][1] == 32
    # the finished run started again: nothing to train, no second evaluation of its last step
    run_opd_launcher(stopped, *common)
    rows = [json.loads(line) for line in (stopped / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/reverse_kl" in r] == [0, 2, 4, 6]


# -------------------------------------------------------------------------------------- ZeRO stages
def _record(trainer):
    """Wrap ``trainer``'s rollouts and steps so the test sees every rollout and every step's KL."""
    rollouts, kls = [], []
    gen, step = trainer._rollouts, trainer.train_step

    def rollouts_hook(n, horizon):
        rs, t = gen(n, horizon)
        rollouts.append([(r.prompt, r.completion) for r in rs])
        return rs, t

    def step_hook():
        out = step()
        kls.append(out["kl"])
        return out

    trainer._rollouts, trainer.train_step = rollouts_hook, step_hook
    return rollouts, kls


def _student_weights(trainer):
    """Full student weights on every rank (the gathered rollout replica under ZeRO-3)."""
    model = trainer._generation_model()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _opd_zero_stages(root, common):
    """Each rank: ZeRO-0, ZeRO-3 (same seeds), then ZeRO-3 resumed from its step-2
    checkpoint and ZeRO-3 with a skipped step; returns rollouts, per-step KL and final weights."""
    import shutil

    import torch.distributed as dist

    from halo_dist.opd.trainer import OPDTrainer

    torch.set_num_threads(1)
    rank, out = dist.get_rank(), {}
    ds = ["parallel.zero_stage=3"]
    runs = [("zero0", ["parallel.zero_stage=0"], ()), ("ds", ds, ()),
            ("resumed", [*ds, "checkpoint.resume=auto"], ()),
            ("skip", [*ds, "optim.nonfinite=skip", "checkpoint.every_steps=1",
                      "checkpoint.keep_last=5"], (2,))]
    for name, extra, nan_steps in runs:  # nan_steps: optimizer steps whose losses are made NaN
        # the ZeRO-3 run's step-2 checkpoint, as if it had stopped there
        if name == "resumed" and rank == 0:
            shutil.copytree(root / "ds" / "checkpoints" / "step-00000002",
                            root / name / "checkpoints" / "step-00000002")
        dist.barrier()
        t = OPDTrainer(tiny_cfg(root / name, *common, *extra, set0=dict(heldout=4)),
                       hf_teacher=tiny_qwen3(vocab=VOCAB), tokenizer=byte_tokenizer()).setup()
        t.loss_hooks.append(nan_at(*nan_steps))
        rollouts, kls = _record(t)
        weights = []
        if name == "skip":
            step = t.train_step
            t.train_step = lambda: (step(), weights.append(_student_weights(t)))[0]
        start = t.step
        t.train()
        t.finish()
        out[name] = {"rollouts": rollouts, "kl": kls, "weights": _student_weights(t),
                     "start": start, "eval": t.eval_history,
                     "per_step": weights, "skipped": t.nonfinite.total,
                     "zero3": hasattr(next(iter(t.module.student.parameters())), "ds_id")}
    return out


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("opd_ds")
    # 2 ranks x micro 1 x grad_accum 2 = 4 rollouts per step; the horizon doubles at step 2
    common = ["schedule.total_steps=4", "schedule.warmup_steps=1", "schedule.decay_steps=2",
              "opd.eval_every=0", "opd.snapshot_every=0", "checkpoint.every_steps=2",
              "data.global_batch_size=4", "data.micro_batch_size=1", "opd.horizon_start=8",
              "opd.horizon_max=16", "opd.plateau_window=1", "opd.plateau_patience=1",
              "opd.plateau_min_rel_improvement=0.5"]
    return run_distributed(_opd_zero_stages, world_size=2, args=(root, common), timeout=600,
                           collective_timeout=120, env={"DS_ACCELERATOR": "cpu"})


@pytest.mark.slow
def test_zero3_matches_zero0(ds_runs):
    for res in ds_runs:
        tor, ds = res["zero0"], res["ds"]
        assert ds["zero3"] and not tor["zero3"]
        # same weights, same seeds: the same samples, step after step
        assert ds["rollouts"] == tor["rollouts"]
        assert len(ds["rollouts"][0]) == 2  # micro 1 x grad_accum 2 per rank
        assert ds["kl"] == pytest.approx(tor["kl"], rel=1e-4), (ds["kl"], tor["kl"])
        assert ds["eval"][0][1] == pytest.approx(tor["eval"][0][1], rel=1e-5)
        assert ds["eval"][-1][1] == pytest.approx(tor["eval"][-1][1], rel=1e-3)
        for k, v in tor["weights"].items():
            # Adam turns round-off-level gradients (measured: 4 of 20480 embedding entries, e.g.
            # rows of tokens that end a document, which predict nothing) into updates of up to lr =
            # 3e-3 per step; everything else agrees to ~1e-5 after 4 steps
            d = (ds["weights"][k] - v).abs()
            assert int((d > 3e-5).sum()) <= 8 and float(d.max()) < 3e-3, (k, float(d.max()))
    # ranks sample different prompts
    assert ds_runs[0]["ds"]["rollouts"] != ds_runs[1]["ds"]["rollouts"]


def test_zero3_resumes_exactly(ds_runs):
    for res in ds_runs:
        ds, resumed = res["ds"], res["resumed"]
        assert resumed["start"] == 2
        assert resumed["rollouts"] == ds["rollouts"][2:]
        assert resumed["kl"] == pytest.approx(ds["kl"][2:], rel=1e-6)
        for k, v in ds["weights"].items():
            assert torch.allclose(resumed["weights"][k], v, rtol=1e-6, atol=1e-7), k


def test_zero3_skips_a_nonfinite_step(ds_runs):
    for res in ds_runs:
        skip = res["skip"]
        assert skip["skipped"] == 1 and len(skip["kl"]) == 4 and math.isnan(skip["kl"][1])
        w1, w2, w3 = skip["per_step"][:3]
        assert all(torch.equal(w1[k], w2[k]) for k in w1)  # step 2 changed nothing
        assert any(not torch.equal(w2[k], w3[k]) for k in w2)  # step 3 did


# -------------------------------------------------------------------------- another number of ranks
def _fixed_batch_run(run_dir, zero, batches, *overrides):
    """The tiny run (4 steps, a checkpoint every 2, resumed automatically) with every step training
    on ``batches`` (rank r takes every world-th one): the same global batches on any number of
    ranks. The RNN group trains at its own LR, which a re-partitioned optimizer must keep."""
    import torch.distributed as dist

    from halo_dist.opd.trainer import OPDTrainer

    cfg = tiny_cfg(run_dir, "schedule.total_steps=4", "schedule.decay_steps=2", "opd.eval_every=0",
                   "opd.snapshot_every=0", "checkpoint.every_steps=2", "checkpoint.resume=auto",
                   "data.global_batch_size=2", "data.micro_batch_size=1", "opd.rnn_lr=1e-3",
                   f"parallel.zero_stage={zero}", *overrides, set0=dict(heldout=0))
    t = OPDTrainer(cfg, hf_teacher=tiny_qwen3(vocab=VOCAB), tokenizer=byte_tokenizer()).setup()
    mine = [b.to(t.device) for b in batches[dist.get_rank()::dist.get_world_size()]]
    t._micro_batches = lambda horizon, on_policy: (mine, 0.0)
    start, reshard = t.step, t.reshard
    t.train()
    return {"start": start, "reshard": reshard, "tokens": t.tokens_seen,
            "horizon": t.horizon.horizon, "weights": _student_weights(t)}


def _resumed_on(run_dir, source, zero, batches, *overrides):
    """``_fixed_batch_run`` in ``run_dir`` after copying ``source``'s step-2 checkpoint into it
    (rank 0)."""
    import shutil

    import torch.distributed as dist

    torch.set_num_threads(1)
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.copytree(source / "checkpoints" / "step-00000002",
                        run_dir / "checkpoints" / "step-00000002")
    if dist.is_initialized():
        dist.barrier()
    return _fixed_batch_run(run_dir, zero, batches, *overrides)


def _two_rank_runs(root, batches):
    """On 2 ranks, for ZeRO 0 and 1: the run from scratch, and the 1-rank run's step 2 resumed."""
    return {zero: (_fixed_batch_run(root / f"two{zero}", zero, batches),
                   _resumed_on(root / f"one_to_two{zero}", root / f"one{zero}", zero, batches))
            for zero in (0, 1)}


@pytest.mark.slow
def test_resume_on_another_number_of_ranks_continues_the_run(tmp_path, capsys):
    """OPD checkpoints written on 1 rank resume on 2 and those of 2 ranks on 1 (a requeue onto
    another number of GPUs), through the Trainer's path: ZeRO 0's whole states load as they are,
    ZeRO-1's partitions are re-made from DeepSpeed's universal checkpoint. On the same global
    batches every run ends where the 1-rank run does, within the 1-vs-2-rank round-off. ZeRO-3 is
    refused with both numbers of ranks: DeepSpeed's ZeRO-3 re-partitioning loses OPD's per-group LRs
    and Adam step."""
    from halo_dist.errors import IncompatibleInputError

    batches = [pack_rollouts([Rollout([5, 6], [7, 8, 9, 10])]),
               pack_rollouts([Rollout([15, 16, 17], [18, 19])])]
    one = {zero: _fixed_batch_run(tmp_path / f"one{zero}", zero, batches) for zero in (0, 1)}
    two = run_distributed(_two_rank_runs, world_size=2, args=(tmp_path, batches), timeout=600,
                          collective_timeout=120, env={"DS_ACCELERATOR": "cpu"})
    capsys.readouterr()
    for zero in (0, 1):
        two_to_one = _resumed_on(tmp_path / f"two_to_one{zero}", tmp_path / f"two{zero}", zero,
                                 batches)
        out = capsys.readouterr().out
        assert ("step-00000002 was written on 2 ranks -> 1 now" in out
                and "resumed from" in out), out[-2000:]
        # the converted copy
        assert not (tmp_path / f"two_to_one{zero}" / "checkpoints" / "universal").exists()
        # per rank of the 2-rank spawn: (its run from scratch, its resume of the 1-rank checkpoint)
        runs = [two_to_one, *(by_rank[zero][1] for by_rank in two),
                *(by_rank[zero][0] for by_rank in two)]
        assert [r["start"] for r in runs] == [2, 2, 2, 0, 0]
        assert [r["reshard"] for r in runs[:3]] == [zero > 0] * 3  # ZeRO 0 needs no conversion
        ref = one[zero]
        for run in runs:
            assert (run["tokens"], run["horizon"]) == (ref["tokens"], ref["horizon"])
            for k, v in ref["weights"].items():
                assert torch.allclose(run["weights"][k], v, rtol=1e-5, atol=1e-6), (zero, k)
    with pytest.raises(IncompatibleInputError,
                       match=r"written on 2 rank\(s\); this run has 1: stage opd under ZeRO-3"):
        _resumed_on(tmp_path / "zero3", tmp_path / "two1", 1, batches, "parallel.zero_stage=3")


def test_an_automatic_resume_of_another_run_is_refused(tmp_path):
    """OPD's auto-resume compares the checkpoint's config like the stages do: another student
    (attention layers) in the same run folder is refused with the difference; a longer schedule is
    allowed."""
    from halo_dist.config import ConfigError

    common = ["opd.eval_every=0", "opd.snapshot_every=0", "checkpoint.every_steps=2",
              "checkpoint.resume=auto", "schedule.decay_steps=1"]
    run_trainer(tiny_cfg(tmp_path, "schedule.total_steps=4", *common, set0=dict(heldout=0)))
    with pytest.raises(ConfigError, match="model.attn_layers"):
        run_trainer(tiny_cfg(tmp_path, "schedule.total_steps=6", "model.attn_layers=2", *common,
                             set0=dict(heldout=0)))


def test_the_removed_backend_key_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError,
                       match=r"opd.backend was removed; OPD always trains under DeepSpeed"):
        tiny_cfg(tmp_path, "opd.backend=torch")


def test_a_checkpoint_config_with_the_removed_backend_key_is_the_same_run(tmp_path):
    """A run saved while OPD still had ``opd.backend`` resumes (the key no longer chooses
    anything)."""
    from halo_dist.config import to_dict
    from halo_dist.train.resume_check import compare

    current = to_dict(tiny_cfg(tmp_path))
    saved = json.loads(json.dumps(current))
    saved["opd"]["backend"] = "deepspeed"
    assert compare(saved, current) == ([], [])
    saved["opd"]["horizon_max"] = 64
    assert compare(saved, current)[0] == ["opd.horizon_max: 64 -> 32"]


def test_the_removed_rollout_streams_key_resumes_only_where_one_decoder_ran(tmp_path):
    """``opd.rollout_streams`` is gone (one decoder steps every slot): a config that sets it is
    told so, a checkpoint saved with 1 resumes, and one saved with 2 (its rollouts drew in two
    groups) is refused, since today's rollouts would not continue its draws."""
    from halo_dist.config import to_dict
    from halo_dist.train.resume_check import compare

    with pytest.raises(ConfigError, match=r"opd.rollout_streams was removed; one decoder"):
        tiny_cfg(tmp_path, "opd.rollout_streams=1")
    current = to_dict(tiny_cfg(tmp_path))
    saved = json.loads(json.dumps(current))
    saved["opd"]["rollout_streams"] = 1
    assert compare(saved, current) == ([], [])
    saved["opd"]["rollout_streams"] = 2
    assert compare(saved, current)[0] == ["opd.rollout_streams: 2 -> removed (runs as 1)"]
