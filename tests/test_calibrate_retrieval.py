"""Logits-scaling calibration by retrieval (``calibrate-scaling --objective retrieval``): prompts
from data_prep.retrieval's phrasings, the chunked answer NLL, the paired choice, refused data, the
CLI end to end."""

import json
import random
import re
import shutil

import pytest
import torch
from conftest import tiny_qwen3

from data_prep.retrieval import FACTS, RECALLS
from halo_dist import cli
from halo_dist.eval import calibrate_retrieval as cr
from halo_dist.eval.errors import EvalError
from halo_dist.eval.niah import NEEDLE, TEMPLATE
from halo_dist.eval.tokenizers import BYTE_VOCAB, byte_tokenizer
from halo_dist.models.convert import convert_model
from halo_dist.models.export import export_hypenet

# text of our own (neither the NIAH filler nor the Wikipedia extracts)
WORDS = ("river", "lamp", "orchard", "ledger", "window", "tractor", "violin", "pepper", "canal",
         "button", "forest", "kettle", "signal", "harvest", "ribbon", "cabinet")
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def filler_text(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words)) + "."


@pytest.fixture(scope="module")
def hypenet_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("calr") / "hypenet"
    # attention layers 0 and 2, a = 500
    export_hypenet(convert_model(tiny_qwen3(vocab=BYTE_VOCAB), [0, 2]), folder,
                   tokenizer=byte_tokenizer())
    return folder


@pytest.fixture(scope="module")
def heldout_manifest(tmp_path_factory, hypenet_folder):
    """Byte-tokenized shards of our own filler text, half of the documents held out."""
    from data_fixtures import run_prep, write_jsonl

    root = tmp_path_factory.mktemp("calr_data")
    src = write_jsonl(root / "filler.jsonl", [filler_text(60, seed=i) for i in range(60)])
    run_prep(root / "data", input=[str(src)], tokenizer=str(hypenet_folder),
             heldout_fraction=0.5, shard_tokens=4000)
    return root / "data"


def _text(tok, ids) -> str:
    return tok.decode(ids)


def test_prompts_state_the_fact_at_the_depth_and_recall_it_in_data_preps_words():
    tok = byte_tokenizer()
    filler = tok.encode(filler_text(200), add_special_tokens=False)
    p = cr.make_prompt(tok, filler, 400, random.Random(3), depth=0.25)
    answer = p.ids[p.answer_start:]
    assert len(p.ids) == 400 and _text(tok, answer) == " " + p.value
    fields = dict(entity=p.entity, attr=p.attr, value=p.value)
    facts = {cr._capital(t.format(**fields)) for t in FACTS}
    fact_ids = next(tok.encode(f"\n\n{f}\n\n", add_special_tokens=False) for f in facts
                    if _text(tok, p.ids[p.fact_at:]).startswith(f"\n\n{f}\n\n"))
    end_fact = p.fact_at + len(fact_ids)
    q = _text(tok, p.ids[:p.answer_start]).rsplit("\n\n", 1)[1]  # the filler has no blank line
    n_fill = p.answer_start - len(tok.encode(f"\n\n{q}", add_special_tokens=False)) - len(fact_ids)
    # the fact sits after a quarter of the filler, the filler around it unchanged and in order
    assert p.fact_at == round(0.25 * n_fill)
    assert p.ids[:p.fact_at] == filler[:p.fact_at]
    assert p.ids[end_fact:end_fact + n_fill - p.fact_at] == filler[p.fact_at:n_fill]
    # the question is a RECALLS template up to its value, and comes after the fact
    assert q in {cr.recall_split(t, fields)[0] for t in RECALLS} and end_fact < p.answer_start


def test_prompts_never_carry_niah_text_and_follow_the_seed():
    tok = byte_tokenizer()
    rows = [tok.encode(filler_text(300, seed=i), add_special_tokens=False) for i in range(3)]
    prompts = cr.make_prompts(tok, rows, 512, 40, seed=7)
    niah = [TEMPLATE.split("{context}")[0].split("{kind}")[0], "special magic",
            "mentioned in the provided text", NEEDLE.split("{kind}")[0].strip()]
    for p in prompts:
        text = _text(tok, p.ids)
        assert len(p.ids) == 512 and not UUID.search(text)
        assert not any(s.lower() in text.lower() for s in niah), text
    assert len({p.filler_row for p in prompts}) == 3  # rows cycle when fewer than prompts
    assert [p.ids for p in cr.make_prompts(tok, rows, 512, 40, seed=7)] == [p.ids for p in prompts]
    assert [p.ids for p in cr.make_prompts(tok, rows, 512, 40, seed=8)] != [p.ids for p in prompts]
    with pytest.raises(EvalError, match="--lengths 40 is too short"):
        cr.make_prompts(tok, rows, 40, 1, seed=0)


def test_answer_nll_equals_the_full_logits_computation(hypenet_folder):
    model, tok = cr.load_folder(hypenet_folder)
    filler = tok.encode(filler_text(100), add_special_tokens=False)
    for seed in range(3):
        p = cr.make_prompt(tok, filler, 160, random.Random(seed))
        nll, exact = cr.answer_score(model, p)
        ids = torch.tensor([p.ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)  # [T, V], all positions
        s = p.answer_start
        target = ids[0, s:]
        expected = -logp[s - 1 : len(p.ids) - 1].gather(1, target[:, None]).sum()
        assert nll == pytest.approx(float(expected), rel=1e-5)
        assert exact == bool((logp[s - 1 : len(p.ids) - 1].argmax(-1) == target).all())


def _point(a, nll):
    return cr.curve_point(a, [(x, x < 1.0) for x in nll])


def test_the_trained_a_stays_unless_another_wins_beyond_the_noise():
    trained = [3.0, 3.4, 2.8, 3.1, 3.6, 2.9, 3.2, 3.0]
    # lower on average, but prompt by prompt it wins some and loses some: noise
    noisy = [2.5, 3.9, 2.2, 3.5, 3.0, 3.4, 2.6, 3.3]
    curves = {256: [_point(None, [5.0] * 8), _point(200.0, noisy), _point(500.0, trained)],
              512: [_point(None, [5.0] * 8), _point(200.0, noisy), _point(500.0, trained)]}
    choice = cr.choose_retrieval(curves, 500.0)
    assert choice["chosen_a"] == 500.0 and "within the noise" in choice["why"]
    assert "16 prompts" in choice["why"]  # both lengths pooled
    # a planted gain of 1 nat +- 0.05 on every prompt clears the interval
    clear = [x - 1.0 + 0.05 * (i % 2) for i, x in enumerate(trained)]
    curves = {256: [_point(200.0, clear), _point(500.0, trained)]}
    choice = cr.choose_retrieval(curves, 500.0)
    assert choice["chosen_a"] == 200.0 and choice["gain"]["nats"] > 0.9
    assert "outside the noise" in choice["why"]


def test_the_niah_haystack_and_random_tokens_are_refused(hypenet_folder, tmp_path, capsys):
    base = ["calibrate-scaling", "--model", str(hypenet_folder), "--objective", "retrieval"]
    for data in ("wiki", "random"):
        assert cli.main(base + ["--data", data]) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(f"error: --data {data}:")  # one line
    assert cli.main(base) == 2  # --data defaults to wiki
    assert "NIAH haystack" in capsys.readouterr().err
    from halo_dist.data.manifest import FORMAT

    wiki_shards = tmp_path / "wiki_data"
    wiki_shards.mkdir()
    (wiki_shards / "manifest.json").write_text(json.dumps(
        {"format": FORMAT, "complete": True, "source": {"kind": "wiki-offline"}, "splits": {}}))
    assert cli.main(base + ["--data", str(wiki_shards)]) == 2
    assert "Wikipedia extracts" in capsys.readouterr().err


def test_shards_of_another_tokenizer_are_refused(hypenet_folder, heldout_manifest, tmp_path,
                                                 capsys):
    other = shutil.copytree(heldout_manifest, tmp_path / "other")
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["tokenizer"]["vocab_sha256"] = "0" * 64  # as if tokenized by another vocabulary
    (other / "manifest.json").write_text(json.dumps(manifest))
    assert cli.main(["calibrate-scaling", "--model", str(hypenet_folder), "--objective",
                     "retrieval", "--data", str(other), "--lengths", "256", "--prompts", "1",
                     "--dry-run"]) == 2
    assert "tokenizer mismatch" in capsys.readouterr().err


def test_cli_runs_end_to_end_and_writes_the_report(hypenet_folder, heldout_manifest, tmp_path,
                                                   capsys):
    folder = tmp_path / "hypenet"
    shutil.copytree(hypenet_folder, folder)
    args = ["calibrate-scaling", "--model", str(folder), "--data", str(heldout_manifest),
            "--objective", "retrieval", "--lengths", "256", "--prompts", "4", "--grid",
            "none,2,500", "--seed", "5"]
    assert cli.main(args + ["--dry-run", "--output", str(tmp_path / "dry.json")]) == 0
    assert json.loads((folder / "config.json").read_text())["attn_logits_scale_base"] == 500.0
    assert cli.main(args + ["--output", str(tmp_path / "r.json")]) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    curve = report["curves"]["256"]
    assert [p["a"] for p in curve] == [None, 2.0, 500.0] and report["trained_a"] == 500.0
    for p in curve:
        assert len(p["prompt_nll"]) == 4 and p["exact"]["n"] == 4 and len(p["exact"]["ci95"]) == 2
        assert p["nll"] == pytest.approx(sum(p["prompt_nll"]) / 4) and p["nll_se"] > 0
        a = "none" if p["a"] is None else format(p["a"], "g")
        assert f"{a:>6} | {p['nll']:9.4f} +- " in printed
    assert [x["length"] for x in report["prompts"]["256"]] == [256] * 4
    assert report["chosen_a"] in (None, 2.0, 500.0) and report["why"]
    assert json.loads((folder / "config.json").read_text())["attn_logits_scale_base"] == (
        report["chosen_a"])
    # deterministic under --seed: the dry run scored the same prompts the same
    assert json.loads((tmp_path / "dry.json").read_text())["curves"] == report["curves"]


def test_demo_calibrates_by_retrieval_only_when_asked(tmp_path):
    from halo_dist.pipeline.demo import Demo, DemoSettings
    from halo_dist.pipeline.steps import DemoStepError

    long = tmp_path / "long"
    long.mkdir()
    student = tmp_path / "out" / "hypenet"
    loss = Demo(DemoSettings(out=str(tmp_path / "out"), data_long=str(long)))
    args = loss.calibrate_args(student, "data")
    # the default: the held-out loss at --long-seq-len, as before
    assert "--objective" not in args and args[args.index("--seq-len") + 1] == "1024"
    assert args[args.index("--rows") + 1] == "2" and args[args.index("--data") + 1] == str(long)
    s = DemoSettings(out=str(tmp_path / "out"), data_long=str(long), calib_objective="retrieval",
                     calib_lengths="32K,64K", calib_prompts=24)
    args = Demo(s).calibrate_args(student, "data")
    assert " ".join(args[args.index("--objective"):args.index("--grid")]) == (
        "--objective retrieval --lengths 32K,64K --prompts 24")
    assert "--rows" not in args and args[args.index("--data") + 1] == str(long)
    s.calib_lengths = ""  # default: the long context
    assert "--lengths 1024" in " ".join(Demo(s).calibrate_args(student, "data"))
    with pytest.raises(DemoStepError, match="--calib-objective retrieval needs --data-long"):
        Demo(DemoSettings(out=str(tmp_path / "out"), calib_objective="retrieval"))
    with pytest.raises(DemoStepError, match="--calib-objective 'nll'"):
        Demo(DemoSettings(out=str(tmp_path / "out"), calib_objective="nll"))


def test_the_demo_report_shows_a_retrieval_calibration(tmp_path):
    from halo_dist.pipeline.report import _calibration_section

    curves = {256: [_point(None, [4.0, 3.0]), _point(500.0, [0.5, 2.0])]}
    report = {"objective": "retrieval", "prompts_per_length": 2, "chosen_a": 500.0,
              "curves": {str(t): c for t, c in curves.items()},
              **{k: v for k, v in cr.choose_retrieval(curves, 500.0).items() if k != "chosen_a"}}
    (tmp_path / "calibrate.json").write_text(json.dumps(report))
    text = "\n".join(_calibration_section(tmp_path))
    assert "answer NLL of a recalled fact" in text and "**a = 500.0**" in text
    assert "| 256 | 500.0 (chosen) | 1.250 ± 0.750 | 50% [" in text
    assert "| 256 | none | 3.500 ± 0.500 | 0% [" in text
