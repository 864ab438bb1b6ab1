"""NIAH: exact token lengths, needle depths, exact-match scoring, reports, batched
decoding."""

import json

import pytest
from conftest import tiny_qwen3

from halo_dist import cli
from halo_dist.eval import niah, niah_report, stats
from halo_dist.eval.errors import EvalError
from halo_dist.eval.tokenizers import BYTE_VOCAB, byte_tokenizer, tokenizer_identity


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from halo_dist.teacher import smollm2_teacher_dir

    return AutoTokenizer.from_pretrained(smollm2_teacher_dir())


def check_sample(tok, s, length, depth):
    """Exact length (also after re-tokenizing the text), needle where claimed, depth within the snap
    window."""
    assert len(s.input_ids) == length
    assert len(tok(tok.decode(s.input_ids), add_special_tokens=False)["input_ids"]) == length
    needle_text = tok.decode(s.input_ids[s.needle_token : s.needle_end])
    assert needle_text.strip().startswith("One of the special magic") and s.answer in needle_text
    assert (s.answer in tok.decode(s.input_ids)
            and tok.decode(s.input_ids).rstrip().endswith("provided text is"))
    haystack = (s.context_end - s.context_start) - (s.needle_end - s.needle_token)
    assert abs(s.actual_depth - depth) <= 25 / haystack + 1e-3, (s.actual_depth, depth)


@pytest.mark.parametrize("task", niah.TASKS)
def test_prompts_have_exact_length_and_depth_with_a_real_bpe_tokenizer(smol_tokenizer, task):
    builder = niah.NiahBuilder(smol_tokenizer)
    for length in (256, 700):
        for depth in (0.0, 0.3, 0.5, 1.0):
            check_sample(smol_tokenizer, builder.sample(task, length, depth), length, depth)


def test_prompts_with_byte_tokenizer_and_distinct_needles():
    tok = byte_tokenizer()
    builder = niah.NiahBuilder(tok)
    samples = [builder.sample("niah_single_3", 1500, d, k) for d in (0.1, 0.9) for k in range(2)]
    for s in samples:
        check_sample(tok, s, 1500, s.depth)
    assert len({s.answer for s in samples}) == 4
    assert all(len(s.answer) == 36 and s.answer.count("-") == 4 for s in samples)  # UUIDs
    # deterministic
    assert builder.sample("niah_single_3", 1500, 0.1, 0).answer == samples[0].answer


def test_answer_matching_is_exact():
    assert niah.answer_found("1234567", " The special magic number is 1234567.")
    assert niah.answer_found("1234567", "1234567")
    assert not niah.answer_found("1234567", "12345678")
    assert not niah.answer_found("1234567", "123456")
    assert not niah.answer_found("1234567", "91234567 and more")
    uid = "8e14b509-e84c-4e23-9e76-a80a0eee1581"
    assert niah.answer_found(uid, f": {uid.upper()}.")
    assert not niah.answer_found(uid, f"{uid}-extra")
    assert not niah.answer_found(uid, uid[:-1])


def test_length_and_depth_parsing():
    assert niah.parse_lengths("4K,8k,1M,3000") == [4096, 8192, 1 << 20, 3000]
    assert niah.parse_depths("5") == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert niah.parse_depths("0,0.5") == [0.0, 0.5]
    for bad, fn in (("4X", niah.parse_lengths), ("10", niah.parse_lengths),
                    ("1.5", niah.parse_depths)):
        with pytest.raises(EvalError):
            fn(bad)
    with pytest.raises(EvalError, match="too short"):
        niah.NiahBuilder(byte_tokenizer()).sample("niah_single_1", 100, 0.5)


def test_scoring_summary_reports_and_heatmap(tmp_path, monkeypatch):
    """An oracle 'model' answers every prompt correctly except those at depth 0: the cells count
    the needles inside the haystack with their intervals, depth 1.0 is reported apart, and table
    and heatmap follow."""
    def oracle(model, tokenizer, rows, max_new_tokens, static=False):
        texts = []
        for r in rows:
            text = tokenizer.decode(r)
            value = text.split(" is: ")[1].split(".")[0]
            texts.append(f" {value}." if text.index(" is: ") > 0.3 * len(text) else " 0000000.")
        return texts

    monkeypatch.setattr(niah, "greedy_generate", oracle)
    cfg = niah.NiahConfig(["niah_single_1", "niah_single_2"], [1024, 2048], [0.0, 0.5, 1.0],
                          samples_per_cell=1, max_length={"niah_single_2": 1024})
    report = {"model": "oracle", **niah.run_niah(None, byte_tokenizer(), cfg, log=lambda m: None)}
    s = report["summary"]["niah_single_1"]
    assert s["by_cell"][1024] == {0.0: 0.0, 0.5: 1.0, 1.0: 1.0} and s["mean"] == 0.5
    assert s["cells"][1024] == {"correct": 1, "n": 2, "rate": 0.5,
                                "ci95": list(stats.wilson(1, 2))}
    assert s["end"][2048]["correct"] == 1 and s["end"][2048]["n"] == 1
    # niah_single_2 stops at its own longest length
    assert list(report["summary"]["niah_single_2"]["cells"]) == [1024]
    paths = niah_report.write_reports(report, tmp_path, "oracle")
    assert (paths["heatmap"].stat().st_size > 1000
            and paths["heatmap"].read_bytes()[:4] == b"\x89PNG")
    table = paths["markdown"].read_text()
    assert "| niah_single_1 | 50% [9-91] n=2 | 50% [9-91] n=2 |" in table, table
    assert "| niah_single_1 (needle at depth 1.0) | 100% [21-100] n=1 |" in table
    assert "| niah_single_2 | 50% [9-91] n=2 | – |" in table
    saved = json.loads(paths["json"].read_text())
    assert len(saved["records"]) == 9 and all(r["prompt_tokens"] == r["length"]
                                              for r in saved["records"])


def test_wilson_interval_and_task_specs():
    assert stats.wilson(20, 20)[0] == pytest.approx(0.8389, abs=1e-4)  # 20 of 20: not [1, 1]
    lo, hi = stats.wilson(10, 50)
    assert (lo, hi) == (pytest.approx(0.1124, abs=1e-4), pytest.approx(0.3304, abs=1e-4))
    assert stats.wilson(0, 0) == (0.0, 1.0)
    assert niah.parse_tasks("niah_single_1, niah_single_3@8K") == (
        ["niah_single_1", "niah_single_3"], {"niah_single_3": 8192})
    for bad in ("niah_single_9", "", "niah_single_1@8X"):
        with pytest.raises(EvalError):
            niah.parse_tasks(bad)


def test_batched_greedy_decoding_on_a_tiny_hypenet():
    """HypeNet's generate runs the batch; each row equals decoding that prompt alone."""
    from halo_dist.models.convert import convert_model

    model = convert_model(tiny_qwen3(vocab=BYTE_VOCAB), [1, 3])
    tok = byte_tokenizer()
    builder = niah.NiahBuilder(tok)
    rows = [builder.sample("niah_single_1", 1024, d).input_ids for d in (0.2, 0.8)]
    together = niah.greedy_generate(model, tok, rows, 4)
    alone = [niah.greedy_generate(model, tok, [r], 4)[0] for r in rows]
    assert together == alone and all(isinstance(t, str) for t in together)


def test_static_decode_gives_the_dynamic_answers_and_runs_only_for_hypenet(monkeypatch):
    """NIAH through HypeNet's static cache answers exactly as with the dynamic one (every record),
    and the option is passed to HypeNet's generate only: another model's generate never sees it."""
    from halo_dist.models.convert import convert_model

    model = convert_model(tiny_qwen3(vocab=BYTE_VOCAB), [1, 3])
    cfg = dict(tasks=["niah_single_1", "niah_single_3"], lengths=[512, 1024], depths=[0.0, 1.0],
               samples_per_cell=2, batch_size=2, max_new_tokens=6)
    run = lambda static: niah.run_niah(model, byte_tokenizer(),  # noqa: E731
                                       niah.NiahConfig(**cfg, static_decode=static),
                                       log=lambda m: None)["records"]
    seen = []
    generate = type(model).generate
    monkeypatch.setattr(type(model), "generate",
                        lambda self, *a, **kw: seen.append(kw.get("cache_implementation"))
                        or generate(self, *a, **kw))
    dynamic, static = run(False), run(True)
    assert static == dynamic and len(static) == 16
    assert set(seen[: len(seen) // 2]) == {None} and set(seen[len(seen) // 2:]) == {"static"}
    assert niah.supports_static_decode(model)
    model.config.model_type = "llama"  # any other model: its own cache
    assert not niah.supports_static_decode(model)


def test_eval_niah_cli_on_the_real_teacher(tmp_path, capsys):
    """SmolLM2 (HF generate path), one 512-token prompt: files written, one record, exact length."""
    out = tmp_path / "niah"
    assert cli.main(["eval-niah", "--model", "smollm2", "--tasks", "niah_single_1", "--lengths",
                     "512", "--depths", "0.5", "--output-dir", str(out), "--name", "smol"]) == 0
    report = json.loads((out / "smol.json").read_text())
    assert len(report["records"]) == 1 and report["records"][0]["prompt_tokens"] == 512
    assert (out / "smol_heatmap.png").exists() and "niah_single_1" in (out / "smol.md").read_text()
    assert cli.main(["eval-niah", "--model", "smollm2", "--tasks", "niah_single_9", "--output-dir",
                     str(out)]) == 2
    assert "unknown NIAH task 'niah_single_9'" in capsys.readouterr().err


def test_batch_by_tokens_sends_long_prompts_alone():
    cfg = niah.NiahConfig(["niah_single_1"], [2048, 65536], [0.5], batch_size=16,
                          batch_tokens=65536)
    assert [cfg.batch_for(n) for n in (2048, 16384, 65536, 131072)] == [16, 4, 1, 1]
    # off: fixed
    assert niah.NiahConfig(["niah_single_1"], [2048], [0.5], batch_size=3).batch_for(65536) == 3


def test_prompt_cache_returns_the_built_prompts_and_keys_on_everything_they_depend_on(
    tmp_path, smol_tokenizer):
    """A cached cell equals a freshly built one; the second read comes from disk; another tokenizer,
    seed, depth list or sample count is another file (never a wrong hit); a half-written file is
    never left."""
    cfg = niah.NiahConfig(["niah_single_2"], [512], [0.0, 1.0], samples_per_cell=2,
                          prompt_cache=str(tmp_path / "p"))
    first, src = niah.PromptCache(cfg.prompt_cache,
                                  niah.NiahBuilder(smol_tokenizer)).cell("niah_single_2", 512, cfg)
    again, src2 = niah.PromptCache(cfg.prompt_cache,
                                   niah.NiahBuilder(smol_tokenizer)).cell("niah_single_2", 512, cfg)
    assert (src, src2) == ("built", "cached") and again == first
    assert first == niah.build_cell(niah.NiahBuilder(smol_tokenizer), "niah_single_2", 512, cfg)
    files = lambda: sorted(p.name for p in (tmp_path / "p").iterdir())  # noqa: E731
    assert len(files()) == 1 and not [f for f in files() if f.endswith(".tmp")]
    variants = [(byte_tokenizer(), cfg, 0), (smol_tokenizer, cfg, 1),
                (smol_tokenizer, niah.NiahConfig(**{**vars(cfg), "depths": [0.0, 0.5]}), 0),
                (smol_tokenizer, niah.NiahConfig(**{**vars(cfg), "samples_per_cell": 1}), 0)]
    for tok, c, seed in variants:
        _, source = niah.PromptCache(cfg.prompt_cache,
                                     niah.NiahBuilder(tok, seed=seed)).cell("niah_single_2", 512, c)
        assert source == "built"
    assert len(files()) == 5
    # transformers sets padding/truncation on the backend per call: not part of the identity
    key = tokenizer_identity(smol_tokenizer)
    smol_tokenizer("a b", padding="max_length", max_length=8, truncation=True)
    assert tokenizer_identity(smol_tokenizer) == key


@pytest.mark.slow
def test_prompts_only_builds_the_cache_that_eval_niah_then_reads(tmp_path, capsys):
    """`eval-niah --prompts-only` needs no model; the evaluation with the same settings reads every
    cell and scores exactly as one that builds its own prompts."""
    import shutil

    from halo_dist.teacher import smollm2_teacher_dir

    # what the GPU machine has before the teacher's GGUF arrives
    tokenizer_only = tmp_path / "tokenizer"
    tokenizer_only.mkdir()
    for f in smollm2_teacher_dir().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tokenizer_only / f.name)
    common = ["--tasks", "niah_single_1,niah_single_3", "--lengths", "512", "--depths", "0.5",
              "--samples", "2"]
    cache = str(tmp_path / "prompts")
    assert cli.main(["eval-niah", "--model", "smollm2", "--prompts-only", *common, "--output-dir",
                     str(tmp_path)]) == 2
    assert "--prompts-only needs --prompt-cache" in capsys.readouterr().err
    assert (cli.main(["eval-niah", "--model", str(tokenizer_only), "--prompts-only",
                      "--prompt-cache", cache, *common, "--output-dir", str(tmp_path / "unused")])
            == 0)
    assert ("2 prompts built" in capsys.readouterr().out
            and len(list((tmp_path / "prompts").iterdir())) == 2)
    assert not (tmp_path / "unused").exists()
    for name, extra in (("cached", ["--prompt-cache", cache]), ("fresh", [])):
        assert cli.main(["eval-niah", "--model", "smollm2", *common, *extra, "--max-new-tokens",
                         "4", "--output-dir", str(tmp_path / "out"), "--name", name]) == 0
    out = capsys.readouterr().out
    assert out.count("prompts cached") == 2 and out.count("prompts built") == 2
    records = {n: json.loads((tmp_path / "out" / f"{n}.json").read_text())["records"]
               for n in ("cached", "fresh")}
    assert records["cached"] == records["fresh"] and len(records["cached"]) == 4
