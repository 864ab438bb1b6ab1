"""Teacher-vs-student scorecards and one-change comparisons: every figure with its n and interval,
differences paired over the same prompts, items and rows."""

import pytest

from halo_dist.eval import scorecard, stats


def _niah(outcomes: dict) -> dict:
    """{(length, depth): [correct, ...]} -> a report with records (one key per prompt)."""
    records = [{"task": "niah_single_1", "length": L, "depth": d, "key": f"k{i}", "correct": c}
               for (L, d), cs in outcomes.items() for i, c in enumerate(cs)]
    return {"records": records}


def _csr(items: str, chance: float = 0.25) -> dict:
    p = items.count("1") / len(items)
    se = stats.mean_se(p, len(items))
    return {"tasks": {"arc_easy": {"acc_norm": p, "n": len(items), "stderr": se, "chance": chance,
                                   "items": items}},
            "csr": p, "csr_tasks": ["arc_easy"], "csr_se": se, "csr_chance": chance}


def test_scorecard_lines_up_cells_margins_and_perplexity():
    teacher = {"niah": _niah({(2048, 0.5): [True] * 9 + [False], (2048, 1.0): [True]}),
               "csr": _csr("1" * 60 + "0" * 40), "ppl": {"ppl": 10.0, "row_ce": [2.3, 2.3]}}
    student = {"niah": _niah({(2048, 0.5): [True] * 5 + [False] * 5, (2048, 1.0): [True]}),
               "csr": _csr("1" * 50 + "0" * 50), "ppl": {"ppl": 11.0, "row_ce": [2.4, 2.4]}}
    card = scorecard.scorecard(teacher, student)
    cell = card["niah"]["niah_single_1"]["cells"][2048]
    assert cell["teacher"]["n"] == 10 and cell["student"]["rate"] == 0.5
    assert card["niah"]["niah_single_1"]["end"][2048]["student"]["n"] == 1  # depth 1.0 apart
    mean = card["csr"]["mean"]
    # (0.50 - 0.25) / (0.60 - 0.25) of the teacher's margin above chance
    assert mean["margin"]["ratio"] == pytest.approx(0.25 / 0.35)
    diff = card["csr"]["tasks"]["arc_easy"]["diff"]
    assert diff["diff"] == pytest.approx(-0.10) and diff["n"] == 100
    assert card["ppl"]["ratio"] == pytest.approx(1.1)
    text = scorecard.markdown(card)
    assert "50% [24-76] n=10" in text and "margin kept" in text and "11.00" in text


def test_compare_pairs_the_same_prompts_and_flags_only_effects_beyond_the_noise():
    base = {"niah": _niah({(4096, 0.5): [False] * 40 + [True] * 10}),
            "csr": _csr("10" * 200), "ppl": {"row_ce": [2.0, 2.1, 2.2, 2.3]}}
    # +30 points on NIAH (15 more of 50 found), CSR unchanged item for item, CE lower on every row
    arm = {"niah": _niah({(4096, 0.5): [True] * 15 + [False] * 25 + [True] * 10}),
           "csr": _csr("10" * 200), "ppl": {"row_ce": [1.9, 2.0, 2.1, 2.2]}}
    diff = scorecard.compare(base, arm)
    cell = diff["niah"]["niah_single_1"]["cells"][4096]
    assert cell["diff"] == pytest.approx(0.3) and cell["ci95"][0] > 0 and cell["n"] == 50
    assert diff["csr"]["arc_easy"]["diff"] == 0.0
    assert diff["ppl"]["diff"] == pytest.approx(-0.1)
    table = scorecard.compare_markdown(diff)
    # NIAH (its cell, and again as the needles at 2K-4K from the start) and the CE (lower on every
    # row) are effects; CSR, unchanged, is not
    assert "+30.0 pt" in table and table.count(" * |") == 3
    assert "| arc_easy | +0.0 pt [+0.0, +0.0] n=400 |" in table


def test_compare_pools_the_needles_by_their_offset_from_the_start():
    """A model that misses the needles near the start of the context and finds the far ones: the
    cells of each length mix both, the offset rows (depth x length, pooled over lengths) split
    them. Depth 1.0 stays out of the offsets as it stays out of the cells."""
    early, late = [False] * 10, [True] * 10
    base = {"niah": _niah({(2048, 0.25): late, (8192, 0.5): [False] * 10, (8192, 1.0): late})}
    arm = {"niah": _niah({(2048, 0.25): [False] * 10, (8192, 0.5): late, (8192, 1.0): early})}
    offsets = scorecard.compare(base, arm)["niah"]["niah_single_1"]["offsets"]
    assert set(offsets) == {"0-1K", "4K+"}  # 2048 x 0.25 = 512; 8192 x 0.5 = 4096
    assert offsets["0-1K"]["diff"] == -1.0 and offsets["4K+"]["diff"] == 1.0
    assert offsets["0-1K"]["n"] == offsets["4K+"]["n"] == 10
    table = scorecard.compare_markdown(scorecard.compare(base, arm))
    rows = [line for line in table.splitlines() if "needle at" in line]
    assert [r.split("needle at ")[1].split(" ")[0] for r in rows] == ["0-1K", "4K+"]


def test_offset_buckets_follow_the_edges():
    from halo_dist.eval.niah_report import offset_bucket, offset_buckets

    assert offset_buckets() == ["0-1K", "1K-2K", "2K-4K", "4K+"]
    assert [offset_bucket(d, L) for d, L in ((0.0, 65536), (0.5, 2048), (0.9, 2048),
                                             (0.25, 8192), (0.1, 65536))] == [
        "0-1K", "1K-2K", "1K-2K", "2K-4K", "4K+"]
