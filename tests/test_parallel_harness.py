"""The multi-rank harness itself: results come back by rank; a failing rank is reported with its
traceback and a hanging rank is stopped quickly."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from distributed import DistributedTestError, run_distributed


def _rank_info(scale: float) -> dict:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "sum": t.item() * scale, "threads": torch.get_num_threads(),
            "env": (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["OMP_NUM_THREADS"])}


def _rank1_fails():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    time.sleep(120)  # rank 0 hangs (a deadlocked collective would look the same to the parent)


def _scenarios() -> dict:
    return {"ok": run_distributed(_rank_info, 2, args=(2.0,), timeout=60),
            "fail": _capture(lambda: run_distributed(_rank1_fails, 2, timeout=60,
                                                     collective_timeout=30, grace=1))}


def _capture(fn):
    start = time.monotonic()
    try:
        fn()
    except DistributedTestError as e:
        return str(e), sorted(e.failures), time.monotonic() - start
    return "no error", [], time.monotonic() - start


@pytest.mark.slow
def test_results_by_rank_and_failures_reported_fast():
    res = _scenarios()
    assert res["ok"] == [{"rank": r, "sum": 2.0, "threads": 1, "env": (str(r), "2", "1")}
                         for r in range(2)]
    message, failed, seconds = res["fail"]
    assert failed == [1] and "boom on rank 1" in message and "--- rank 1 ---" in message
    assert "ranks [0] did not report" in message
    assert seconds < 20  # stopped after the 1 s grace, not the 60 s timeout
