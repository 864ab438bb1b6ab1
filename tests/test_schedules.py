"""LR schedules: closed forms, WSD rung extension, LambdaLR integration and resume."""
from __future__ import annotations

import math

import pytest
import torch

from halo_dist.config import load_config
from halo_dist.train.schedules import LRSchedule, make_lr_scheduler

PEAK, FLOOR = 1e-4, 1e-5


def schedule(kind="cosine", total=1000, warmup=50, **kw) -> LRSchedule:
    return LRSchedule(kind=kind, peak_lr=PEAK, min_lr=FLOOR, warmup_steps=warmup,
                      total_steps=total, **kw)


def test_warmup_is_linear_and_reaches_peak():
    s = schedule()
    assert s.lr_at(0) == pytest.approx(PEAK / 50)
    assert s.lr_at(24) == pytest.approx(PEAK * 25 / 50)
    assert s.lr_at(49) == pytest.approx(PEAK) and s.lr_at(50) == pytest.approx(PEAK)


@pytest.mark.parametrize("step", [50, 100, 525, 999, 1000, 5000])
def test_cosine_and_linear_closed_forms(step):
    p = min(1.0, (step - 50) / 950)
    cos = FLOOR + (PEAK - FLOOR) * 0.5 * (1 + math.cos(math.pi * p))
    lin = FLOOR + (PEAK - FLOOR) * (1 - p)
    assert schedule("cosine").lr_at(step) == pytest.approx(cos, rel=1e-12)
    assert schedule("linear").lr_at(step) == pytest.approx(lin, rel=1e-12)


def test_cosine_midpoint_and_end():
    s = schedule(warmup=0, total=100)
    assert s.lr_at(50) == pytest.approx((PEAK + FLOOR) / 2)
    assert s.lr_at(100) == pytest.approx(FLOOR) and s.lr_at(10**6) == pytest.approx(FLOOR)


def test_constant_with_warmup():
    s = schedule("constant", warmup=10)
    assert s.lr_at(4) == pytest.approx(PEAK / 2)
    assert all(s.lr_at(k) == PEAK for k in (10, 500, 999, 10**6))
    assert s.is_pre_decay(999)


@pytest.mark.parametrize("shape, f", [("linear", lambda q: 1 - q),
                                      ("cosine", lambda q: 0.5 * (1 + math.cos(math.pi * q))),
                                      ("sqrt", lambda q: 1 - math.sqrt(q))])
def test_wsd_closed_form(shape, f):
    s = schedule("wsd", total=1000, warmup=50, decay_steps=200, decay_shape=shape)
    assert s.decay_start == 800
    assert s.lr_at(300) == PEAK and s.lr_at(800) == PEAK
    for step in (801, 850, 900, 999, 1000):
        q = (step - 800) / 200
        assert s.lr_at(step) == pytest.approx(FLOOR + (PEAK - FLOOR) * f(q), rel=1e-12)
    assert s.lr_at(5000) == pytest.approx(FLOOR)
    assert s.is_pre_decay(800) and not s.is_pre_decay(801)


def test_wsd_rung_extension_retraces_history():
    """A longer WSD run resumed from a pre-decay snapshot has the identical LR up to it."""
    short = schedule("wsd", total=1000, decay_steps=200)
    for longer_total in (1001, 2000, 32000):
        longer = schedule("wsd", total=longer_total, decay_steps=200)
        assert all(short.lr_at(k) == longer.lr_at(k) for k in range(short.decay_start + 1))
        longer.check_resume(short.state_dict(), step=short.decay_start)  # allowed
        with pytest.raises(ValueError, match="pre-decay snapshot"):
            longer.check_resume(short.state_dict(), step=short.decay_start + 1)


def test_check_resume_refuses_changed_schedules():
    base = schedule()
    base.check_resume(base.state_dict(), step=700)
    with pytest.raises(ValueError, match="differs"):
        LRSchedule(**{**base.state_dict(), "peak_lr": 2e-4}).check_resume(base.state_dict(), 10)
    with pytest.raises(ValueError, match="differs"):  # a longer cosine changes past LRs
        schedule(total=2000).check_resume(base.state_dict(), step=100)
    schedule(total=2000).check_resume(base.state_dict(), step=50)  # still at peak: identical


def test_lambda_lr_follows_lr_at_and_resumes():
    s = schedule("wsd", total=40, warmup=5, decay_steps=10)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=s.peak_lr)
    sched = make_lr_scheduler(opt, s)
    seen = []
    for _ in range(20):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([s.lr_at(k) for k in range(20)], rel=1e-12)
    state = sched.state_dict()
    assert state["lr_lambdas"] == [None]  # the closure is not pickled: the config rebuilds it
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=s.peak_lr)
    longer = schedule("wsd", total=80, warmup=5, decay_steps=10)
    sched2 = make_lr_scheduler(opt2, longer)
    sched2.load_state_dict(state)
    opt2.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(longer.lr_at(21))


def test_optimizer_lr_must_be_peak():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="peak_lr"):
        make_lr_scheduler(opt, schedule())


@pytest.mark.parametrize("kw", [dict(kind="step"), dict(warmup=1000), dict(kind="wsd"),
                                dict(kind="wsd", decay_steps=990),
                                dict(kind="wsd", decay_steps=10, decay_shape="exp")])
def test_invalid_schedules(kw):
    with pytest.raises(ValueError):
        schedule(**kw)


def test_from_config_uses_derived_total(tmp_path):
    from pathlib import Path
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs/stages/2b/stage2.yaml")
    s = LRSchedule.from_config(cfg)
    assert (s.kind, s.peak_lr, s.min_lr, s.warmup_steps, s.total_steps) == (
        "cosine", 1e-4, 1e-5, 50, 20346)
