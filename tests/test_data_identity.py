"""Every shard is checked against the manifest's
tokenizer and dtype, a shard listed twice is refused, token ids beyond the model's vocabulary are
refused before training (bare shards and a manifest with a wrong ``vocab_size`` included), data_prep
names the file and line of invalid UTF-8 or a ``text`` that is not a string, and a resume accepts
the same shards under another path."""
from __future__ import annotations

import io
import json
import logging
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from data_fixtures import run_prep, wiki_docs, write_jsonl
from halo_dist.data import DataError, build_loader, resolve_shards

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny"


def wordlevel_tokenizer(folder: Path) -> Path:
    """A 4-word tokenizer folder (another tokenizer than the data sets' Qwen one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, Path]:
    """``qwen``: Qwen-tokenized Wikipedia (uint32, 3+ shards); ``words16`` / ``words32``: another
    tokenizer's shards as uint16 / uint32."""
    root = tmp_path_factory.mktemp("datasets")
    src = write_jsonl(root / "wiki.jsonl", wiki_docs(40))
    words = write_jsonl(root / "words.jsonl", ["hello world"] * 300)
    tok = str(wordlevel_tokenizer(root / "tok"))
    run_prep(root / "qwen", input=[str(src)], shard_tokens=4000)
    run_prep(root / "words16", input=[str(words)], tokenizer=tok)
    run_prep(root / "words32", input=[str(words)], tokenizer=tok, dtype="uint32")
    return {name: root / name for name in ("qwen", "words16", "words32")}


def stage_config(data, *overrides):
    """The tiny stage-2 config on ``data`` with its random teacher over the real Qwen vocabulary
    (these data sets are Qwen-tokenized; nothing is trained, so the vocabulary costs nothing)."""
    from halo_dist.config import load_config

    return load_config(TINY / "stage2.yaml", [f"data.train={data}", "eval.every_steps=0",
                                              "model.stage1_weights=null",
                                              "model.random_teacher.vocab_size=151936", *overrides])


def check_before_training(cfg) -> None:
    """What a one-rank run checks before it builds anything."""
    from halo_dist.train.data_checks import check_training_data

    check_training_data(cfg, 0, 1)


def with_foreign_shard(tmp_path: Path, base: Path, other: Path) -> tuple[Path, str]:
    """A copy of ``base`` whose manifest also lists ``other``'s first shard (its record copied, as
    a merge script would): returns the folder and that shard's name."""
    mixed = Path(shutil.copytree(base, tmp_path / f"mixed-{other.name}"))
    record = dict(json.loads((other / "manifest.json").read_text())["splits"]["train"]["shards"][0])
    name = "shard-foreign.tar"
    shutil.copy(other / record["path"], mixed / "train" / name)
    manifest = json.loads((mixed / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"].append({**record, "path": f"train/{name}"})
    (mixed / "manifest.json").write_text(json.dumps(manifest))
    return mixed, name


@pytest.mark.parametrize("other", ["words32", "words16"])
def test_a_shard_of_another_tokenizer_or_dtype_in_a_manifest_is_refused(datasets, tmp_path, other):
    mixed, name = with_foreign_shard(tmp_path, datasets["qwen"], datasets[other])
    with pytest.raises(DataError) as err:
        check_before_training(stage_config(mixed))
    assert name in str(err.value) and ("tokenizer" in str(err.value) or "dtype" in str(err.value))
    # a loader built outside a training run (evaluation) refuses it when it first reads it
    with pytest.raises(DataError, match=name):
        for _ in build_loader(mixed, 64, 2, shuffle=False, max_epochs=1):
            pass


def test_a_shard_listed_twice_is_refused(datasets, tmp_path):
    twice = Path(shutil.copytree(datasets["qwen"], tmp_path / "twice"))
    manifest = json.loads((twice / "manifest.json").read_text())
    shards = manifest["splits"]["train"]["shards"]
    shards.append(dict(shards[0]))
    (twice / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="listed twice") as err:
        resolve_shards(twice)
    assert shards[0]["path"] in str(err.value)
    # the same shard copied under another name: the same tokens twice
    shards.pop()
    shutil.copy(twice / shards[0]["path"], twice / "train" / "copy.tar")
    shards.append({**shards[0], "path": "train/copy.tar"})
    (twice / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="copy.tar"):
        build_loader(twice, 64, 2)
    first = str(datasets["qwen"] / shards[0]["path"])
    with pytest.raises(DataError, match="listed twice"):
        resolve_shards([str(datasets["qwen"] / "train" / "*.tar"), first])


def _foreign_tool_shard(path: Path, ids: np.ndarray) -> Path:
    """A webdataset shard written by another tool (plain tarfile, no halo_dist header)."""
    buf = io.BytesIO()
    np.save(buf, ids)
    with tarfile.open(path, "w") as t:
        info = tarfile.TarInfo("d000000000000p00000.tokens.npy")
        info.size = len(buf.getvalue())
        t.addfile(info, io.BytesIO(buf.getvalue()))
    return path


def test_ids_beyond_the_models_vocabulary_are_refused_before_training(datasets, tmp_path):
    small = ["model.random_teacher.vocab_size=1000"]
    qwen = datasets["qwen"]
    # bare shards (no manifest) of Qwen ids for a 1000-token model
    with pytest.raises(DataError, match="1,000") as err:
        check_before_training(stage_config(qwen / "train" / "*.tar", *small))
    assert "shard-0000" in str(err.value)
    # a manifest that claims a 1000-token vocabulary
    wrong = Path(shutil.copytree(qwen, tmp_path / "wrong"))
    manifest = json.loads((wrong / "manifest.json").read_text())
    manifest["tokenizer"]["vocab_size"] = 1000
    (wrong / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="1,000"):
        check_before_training(stage_config(wrong, *small))
    # a shard of another tool, scanned
    bare = _foreign_tool_shard(tmp_path / "other.tar", np.arange(990, 1010, dtype=np.uint32))
    with pytest.raises(DataError, match="1009"):
        check_before_training(stage_config(bare, *small))
    # what fits passes
    check_before_training(stage_config(qwen))
    check_before_training(stage_config(_foreign_tool_shard(tmp_path / "fits.tar",
                                                           np.arange(0, 1000, dtype=np.uint32)),
                                       *small, "data.seq_len=64"))


@pytest.mark.parametrize("suffix", [".jsonl", ".txt", ".json"])
def test_invalid_utf8_in_data_prep_input_names_the_file_and_line(tmp_path, suffix, caplog):
    from data_prep.tokenize import main

    bad = tmp_path / f"bad{suffix}"
    lines = [b'{"text": "fine"}', b'{"text": "also fine"}', b'{"text": "caf\xe9"}']
    if suffix == ".json":
        lines = [b"[", b'{"text": "fine"},', b'{"text": "caf\xe9"}]']
    bad.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError, match="UTF-8") as err:
        run_prep(tmp_path / "o", input=[str(bad)])
    assert err.value.file == str(bad) and err.value.key == "line 3"
    with caplog.at_level(logging.ERROR):
        assert main(["--input", str(bad), "--tokenizer", "offline-qwen3", "--out",
                     str(tmp_path / "o2"), "--no-progress", "--num-proc", "1"]) == 2
    assert [r.message for r in caplog.records if r.levelno >= logging.ERROR][-1].count("\n") == 0


@pytest.mark.parametrize("value", [5, None, ["a", "list"], {"a": "dict"}])
def test_a_text_that_is_not_a_string_names_the_file_and_line(tmp_path, value):
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": value}) + "\n")
    with pytest.raises(DataError, match="not a string") as err:
        run_prep(tmp_path / "o", input=[str(src)])
    assert err.value.file == str(src) and err.value.key == "line 2"


def test_a_resume_compares_data_train_by_content(datasets, tmp_path):
    """The checkpoint's loader recorded its shards' fingerprint: the same shards under another path
    resume; other shards under the old path are refused."""
    from halo_dist.config import ConfigError, save_resolved
    from halo_dist.train.resume_check import check_same_run

    qwen = datasets["qwen"]
    ckpt = tmp_path / "step-00000002"
    ckpt.mkdir()
    save_resolved(stage_config(qwen), ckpt / "config.yaml")
    state = {"loader": build_loader(qwen, 64, 2).state_dict()}  # what the trainer saves
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    moved = shutil.copytree(qwen, tmp_path / "moved")
    check_same_run(ckpt, stage_config(moved), None, announce=False)
    with pytest.raises(ConfigError, match="data.train"):
        check_same_run(ckpt, stage_config(datasets["words32"]), None, announce=False)


@pytest.mark.parametrize("source", ["missing", "empty_folder", "broken_manifest"])
def test_a_missing_or_unreadable_data_train_is_named_before_the_held_out_split(tmp_path, source):
    """``data.train`` is what the user got wrong: the error names it with the command that makes
    shards, not the held-out split that is read from it."""
    path = tmp_path / "no_such_data"
    if source != "missing":
        path.mkdir()
    if source == "broken_manifest":
        (path / "manifest.json").write_text("{not json")
    cfg = stage_config(path, "eval.every_steps=4")
    with pytest.raises(DataError) as err:
        check_before_training(cfg)
    msg = str(err.value)
    assert (f"data.train={path}" in msg and "python -m data_prep.tokenize" in msg
            and "eval.every_steps" not in msg and "heldout" not in msg), msg
