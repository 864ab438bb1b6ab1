"""data_prep.tokenize: text -> shards -> manifest; determinism, resume, splits, inputs, bad
input."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_fixtures import qwen_tokenizer, run_prep, wiki_dataset, wiki_docs, write_jsonl
from halo_dist.data import DataError, check_tokenizer, load_manifest, scan_shard
from halo_dist.data.shards import ShardReader

EOS = 151643


def _samples(manifest_dir: Path, split: str = "train") -> list[np.ndarray]:
    """All token arrays of a split in file order."""
    out = []
    for s in load_manifest(manifest_dir, split).shards:
        r = ShardReader(scan_shard(s.path))
        out += [np.array(r.tokens(i)) for i in range(r.index.num_samples)]
        r.close()
    return out


def _shard_bytes(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*.tar"))}


def test_round_trip_text_to_tokens(tmp_path):
    texts = wiki_docs(120)
    src = write_jsonl(tmp_path / "in" / "docs.jsonl", texts)
    m = run_prep(tmp_path / "out", input=[str(src)], shard_tokens=4000)
    assert m["complete"] and m["totals"]["docs"] == len(texts)
    assert m["tokenizer"]["eos_id"] == EOS and m["dtype"] == "uint32"
    tok = qwen_tokenizer()
    samples = _samples(tmp_path / "out")
    assert len(samples) == len(texts)
    for text, arr in zip(texts, samples):
        assert arr[-1] == EOS and EOS not in arr[:-1]
        assert tok.decode(arr[:-1].tolist()) == text
    rec = m["splits"]["train"]
    assert rec["tokens"] == sum(len(a) for a in samples) == sum(s["tokens"] for s in rec["shards"])
    assert all(s["tokens"] >= 4000 for s in rec["shards"][:-1])  # shards close at doc boundaries
    check_tokenizer(tmp_path / "out", tok)


def test_webdataset_reads_shards():
    import webdataset as wds

    d = wiki_dataset()
    url = str(d / "train" / "shard-000000.tar")
    got = [s["tokens.npy"] for s in wds.WebDataset(url, shardshuffle=False).decode()]
    assert [a.tolist() for a in got] == [a.tolist() for a in _samples_one(url)]


def _samples_one(path):
    r = ShardReader(scan_shard(path))
    return [np.array(r.tokens(i)) for i in range(r.index.num_samples)]


def test_deterministic_and_num_proc_independent(tmp_path):
    a = run_prep(tmp_path / "a", max_docs=150, shard_tokens=3000, heldout_fraction=0.1)
    b = run_prep(tmp_path / "b", max_docs=150, shard_tokens=3000, heldout_fraction=0.1, num_proc=2)
    assert _shard_bytes(tmp_path / "a") == _shard_bytes(tmp_path / "b")
    assert a["splits"] == b["splits"]


def test_heldout_budget_and_pieces(tmp_path):
    m = run_prep(tmp_path / "o", max_docs=300, shard_tokens=3000, heldout_fraction=0.1,
                 max_tokens=8000, max_doc_tokens=64)
    tr, ho = m["splits"]["train"], m["splits"]["heldout"]
    assert 8000 <= tr["tokens"] < 8000 + 64 * 50 and ho["docs"] > 0
    assert tr["samples"] > tr["docs"]  # long docs became pieces
    import webdataset as wds
    metas = [s for s in wds.WebDataset(str(tmp_path / "o" / tr["shards"][0]["path"]),
                                       shardshuffle=False).decode() if "piece.json" in s]
    assert metas, "expected split documents"
    by_doc = {}
    for s in metas:
        meta = s["piece.json"]
        by_doc.setdefault(meta["doc"], []).append((meta, s["tokens.npy"]))
    for pieces in by_doc.values():
        n = pieces[0][0]["num_pieces"]
        assert [p[0]["piece"] for p in pieces] == list(range(n))
        assert [p[0]["continues"] for p in pieces] == [True] * (n - 1) + [False]
        assert all(len(t) <= 64 for _, t in pieces) and pieces[-1][1][-1] == EOS
        assert all(EOS not in t for _, t in pieces[:-1])
    train_first = [s["first_doc"] for s in tr["shards"]]
    assert train_first == sorted(train_first)


def test_crash_then_resume_is_identical(tmp_path, monkeypatch):
    import data_prep.tokenize as T

    kw = dict(max_docs=200, shard_tokens=2500, heldout_fraction=0.1)
    ref = run_prep(tmp_path / "ref", **kw)
    calls = {"n": 0}
    real_add = T.SplitWriter.add

    def flaky(self, doc, tokens, max_doc_tokens, **kw):
        calls["n"] += 1
        if calls["n"] == 120:
            raise RuntimeError("simulated crash")
        return real_add(self, doc, tokens, max_doc_tokens, **kw)

    monkeypatch.setattr(T.SplitWriter, "add", flaky)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_prep(tmp_path / "run", **kw)
    monkeypatch.setattr(T.SplitWriter, "add", real_add)
    part = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert not part["complete"] and part["totals"]["shards"] >= 2
    # no half-written file
    assert not [p for p in (tmp_path / "run").rglob("*") if ".tmp-" in p.name]
    done = {s["path"]: (tmp_path / "run" / s["path"]).stat().st_mtime_ns
            for sp in part["splits"].values() for s in sp["shards"]}
    m = run_prep(tmp_path / "run", **kw)
    assert m["complete"] and m["splits"] == ref["splits"]
    assert {k: v for k, v in m.items() if k != "args"} == {k: v
                                                           for k, v in ref.items() if k != "args"}
    assert _shard_bytes(tmp_path / "run") == _shard_bytes(tmp_path / "ref")
    for path, mtime in done.items():  # finished shards were kept, not rewritten
        assert (tmp_path / "run" / path).stat().st_mtime_ns == mtime
    again = run_prep(tmp_path / "run", **kw)  # complete: nothing to do
    assert again["splits"] == ref["splits"]


def test_rerun_with_other_args_refused(tmp_path):
    run_prep(tmp_path / "o", max_docs=50, shard_tokens=2000)
    before = _shard_bytes(tmp_path / "o")
    with pytest.raises(DataError, match="different arguments.*shard_tokens") as e:
        run_prep(tmp_path / "o", max_docs=50, shard_tokens=3000)
    assert e.value.key == "config" and e.value.file.endswith("manifest.json")
    assert _shard_bytes(tmp_path / "o") == before


def test_resume_refuses_damaged_finished_shard(tmp_path, monkeypatch):
    import data_prep.tokenize as T

    kw = dict(max_docs=120, shard_tokens=2000)
    real = T.SplitWriter.add
    n = {"c": 0}

    def crash(self, *a, **kw):
        n["c"] += 1
        if n["c"] == 80:
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(T.SplitWriter, "add", crash)
    with pytest.raises(KeyboardInterrupt):
        run_prep(tmp_path / "o", **kw)
    monkeypatch.setattr(T.SplitWriter, "add", real)
    shard = tmp_path / "o" / "train" / "shard-000000.tar"
    data = bytearray(shard.read_bytes())
    data[1500] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError) as e:
        run_prep(tmp_path / "o", **kw)
    assert "shard-000000.tar" in str(e.value)


def test_local_formats_parquet_txt_gz(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = list(wiki_docs(30))
    pq.write_table(pa.table({"content": texts[:10]}), tmp_path / "a.parquet")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        for t in texts[10:20]:
            f.write(json.dumps({"content": t}) + "\n")
    (tmp_path / "txt").mkdir()
    for i, t in enumerate(texts[20:30]):
        (tmp_path / "txt" / f"{i:02d}.txt").write_text(t)
    m = run_prep(tmp_path / "o", input=[str(tmp_path / "a.parquet"), str(tmp_path / "b.jsonl.gz"),
                                        str(tmp_path / "txt" / "*.txt")], text_field="content")
    tok = qwen_tokenizer()
    got = [tok.decode(a[:-1].tolist()) for a in _samples(tmp_path / "o")]
    assert got == texts and m["source"]["kind"] == "files"


def test_hf_streaming_path(tmp_path, monkeypatch):
    import datasets

    seen = {}

    def fake_load(name, config=None, split=None, streaming=False, **kw):
        seen.update(name=name, config=config, split=split, streaming=streaming)
        return iter([{"text": t} for t in wiki_docs(20)])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    m = run_prep(tmp_path / "o", hf_dataset="HuggingFaceFW/fineweb-edu", hf_config="sample-10BT",
                 wiki_offline=False)
    assert seen == {"name": "HuggingFaceFW/fineweb-edu", "config": "sample-10BT", "split": "train",
                    "streaming": True}
    assert m["totals"]["docs"] == 20


def test_bad_source_records(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(DataError) as e:
        run_prep(tmp_path / "o", input=[str(p)])
    assert e.value.file == str(p) and e.value.key == "line 2"
    q = tmp_path / "nofield.jsonl"
    q.write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match="no text field 'text'"):
        run_prep(tmp_path / "o2", input=[str(q)])
    with pytest.raises(DataError, match="matched no files"):
        run_prep(tmp_path / "o3", input=[str(tmp_path / "none-*.jsonl")])


def test_empty_documents_skipped(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", ["alpha beta", "", "   ", "gamma"])
    m = run_prep(tmp_path / "o", input=[str(p)])
    assert m["totals"]["docs"] == 2 and m["totals"]["empty_docs_skipped"] == 2
    assert (m["splits"]["train"]["shards"][0]["first_doc"] == 0
            and m["splits"]["train"]["shards"][0]["last_doc"] == 3)


@pytest.mark.slow
def test_cli_help_and_run(tmp_path, capsys):
    from data_prep.tokenize import main

    with pytest.raises(SystemExit) as ex:
        main(["--help"])
    out = capsys.readouterr().out
    assert (ex.value.code == 0 and "--wiki-offline" in out and "Examples" in out
            and "--max-tokens 1B" in out)
    assert main(["--input", str(tmp_path / "nope.jsonl"), "--tokenizer", "offline-qwen3",
                 "--out", str(tmp_path / "o2"), "--no-progress"]) == 2
    # the real entry point, as users type it
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    src = write_jsonl(tmp_path / "d.jsonl", wiki_docs(10))
    r = subprocess.run([sys.executable, "-m", "data_prep.tokenize", "--input",
                        str(src), "--tokenizer", "offline-qwen3", "--out",
                        str(tmp_path / "o"), "--no-progress", "--num-proc", "1"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "10 docs" in r.stdout and (tmp_path / "o" / "train" / "shard-000000.tar").is_file()


def test_any_hf_tokenizer_folder_uint16(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from halo_dist.data import build_loader

    vocab = {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(tmp_path / "tok")
    src = write_jsonl(tmp_path / "d.jsonl", ["hello world"] * 30 + ["world hello hello"] * 30)
    m = run_prep(tmp_path / "o", input=[str(src)], tokenizer=str(tmp_path / "tok"))
    assert (m["dtype"] == "uint16" and m["tokenizer"]["eos_id"] == 1
            and m["tokenizer"]["eos_token"] == "<eos>")
    b = next(iter(build_loader(tmp_path / "o", 6, 2, shuffle=False)))
    assert b["input_ids"].tolist() == [[2, 3, 1, 2, 3, 1], [2, 3, 1, 2, 3, 1]]
    assert b["labels"].tolist()[0] == [3, 1, -100, 3, 1, -100]


def test_the_tiny_configs_tokenizer_round_trips_and_is_the_same_on_every_build(tmp_path):
    """offline-wiki-bpe4k (configs/tiny's): 4,096 ids, ``<|endoftext|>`` = 0 as the shards' EOS,
    uint16 shards that decode to their text; trained again into an empty cache it has the same
    vocabulary (the hash the manifests record), so every machine makes the same tiny shards."""
    from data_fixtures import TINY_TOKENIZER, small_tokenizer

    from halo_dist.assets.tokenizer import load_small_tokenizer
    from halo_dist.data import vocab_sha256

    tok, texts = small_tokenizer(), wiki_docs(40)
    m = run_prep(tmp_path / "out", input=[str(write_jsonl(tmp_path / "d.jsonl", texts))],
                 tokenizer=TINY_TOKENIZER)
    assert len(tok) == 4096 and m["tokenizer"]["eos_id"] == 0 and m["dtype"] == "uint16"
    for text, arr in zip(texts, _samples(tmp_path / "out")):
        assert arr[-1] == 0 and 0 not in arr[:-1] and tok.decode(arr[:-1].tolist()) == text
    rebuilt = load_small_tokenizer(cache=tmp_path / "cache")
    assert vocab_sha256(rebuilt) == vocab_sha256(tok) == m["tokenizer"]["vocab_sha256"]


def test_concurrent_run_into_same_folder_refused(tmp_path):
    fcntl = pytest.importorskip("fcntl")
    out = tmp_path / "o"
    out.mkdir()
    with open(out / ".data_prep.lock", "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        with pytest.raises(DataError, match="another data_prep run"):
            run_prep(out, max_docs=5)
    assert run_prep(out, max_docs=5)["complete"]


def test_manifest_counts_each_input_file_and_survives_resume(tmp_path, monkeypatch):
    import data_prep.tokenize as T

    texts = wiki_docs(160)
    files = [write_jsonl(tmp_path / "in" / "a.jsonl", texts[:60]),
             write_jsonl(tmp_path / "in" / "sub" / "b.jsonl", ["", *texts[60:]])]
    kw = dict(input=[str(f) for f in files], shard_tokens=2500, heldout_fraction=0.1)
    ref = run_prep(tmp_path / "ref", **kw)
    for split in ("train", "heldout"):
        sp = ref["splits"][split]
        assert set(sp["sources"]) == {"a.jsonl", "sub/b.jsonl"}
        assert sum(c["tokens"] for c in sp["sources"].values()) == sp["tokens"]
        assert sum(c["docs"] for c in sp["sources"].values()) == sp["docs"]
    assert sum(ref["splits"][s]["sources"]["a.jsonl"]["docs"] for s in ("train", "heldout")) == 60
    # "" skipped
    assert (sum(ref["splits"][s]["sources"]["sub/b.jsonl"]["docs"] for s in ("train", "heldout"))
            == 100)
    tok = qwen_tokenizer()
    a_tokens = sum(len(tok(t)["input_ids"]) + 1 for i, t in enumerate(texts[:60])
                   if not T.is_heldout(i, 0.1, 0))
    assert ref["splits"]["train"]["sources"]["a.jsonl"]["tokens"] == a_tokens

    real_add, calls = T.SplitWriter.add, {"n": 0}

    def flaky(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 90:  # inside the second file, with finished shards of both behind
            raise RuntimeError("simulated crash")
        return real_add(self, *a, **k)

    monkeypatch.setattr(T.SplitWriter, "add", flaky)
    with pytest.raises(RuntimeError):
        run_prep(tmp_path / "run", **kw)
    monkeypatch.setattr(T.SplitWriter, "add", real_add)
    part = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert not part["complete"] and "a.jsonl" in part["splits"]["train"]["sources"]
    m = run_prep(tmp_path / "run", **kw)
    assert {k: v for k, v in m.items() if k != "args"} == {k: v
                                                           for k, v in ref.items() if k != "args"}
