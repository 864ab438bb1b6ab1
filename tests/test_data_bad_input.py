"""Bad input: missing/truncated/corrupt tars, samples without tokens, manifest disagreements,
empty shard lists, tokenizer mismatch, skip-corrupt mode, atomic writes."""
from __future__ import annotations

import io
import json
import logging
import shutil
import tarfile

import numpy as np
import pytest

from data_fixtures import qwen_tokenizer, wiki_dataset
from halo_dist.data import DataError, ShardWriter, build_loader, check_tokenizer, scan_shard
from halo_dist.data.fileio import atomic_write_json


@pytest.fixture
def data(tmp_path):
    """A private copy of the small wiki data set that a test may damage."""
    return shutil.copytree(wiki_dataset(), tmp_path / "d")


def _iterate(loader, n=10_000):
    for i, _ in enumerate(loader):
        if i >= n:
            break


def _manifest(d):
    return json.loads((d / "manifest.json").read_text())


def _write_manifest(d, m):
    (d / "manifest.json").write_text(json.dumps(m))


def _flip(path, offset):
    b = bytearray(path.read_bytes())
    b[offset] ^= 0x5A
    path.write_bytes(bytes(b))


def test_missing_shard(data):
    (data / "train" / "shard-000003.tar").unlink()
    with pytest.raises(DataError, match="missing") as e:
        build_loader(data, 128, 2)
    assert e.value.file.endswith("train/shard-000003.tar")


def test_truncated_shard(data):
    p = data / "train" / "shard-000001.tar"
    p.write_bytes(p.read_bytes()[:3000])
    with pytest.raises(DataError, match="manifest says") as e:
        build_loader(data, 128, 2)
    assert e.value.file.endswith("shard-000001.tar") and e.value.key == "bytes"
    # without a manifest: structure check
    with pytest.raises(DataError, match="truncated tar") as e:
        scan_shard(p)
    assert e.value.file.endswith("shard-000001.tar")
    with pytest.raises(DataError, match="truncated tar"):
        build_loader([p], 128, 2)


def test_corrupt_tar_header(data):
    p = data / "train" / "shard-000002.tar"
    _flip(p, 10)  # inside the first member's name: header checksum breaks, size unchanged
    # size check passes; structure is checked on first use
    ld = build_loader(data, 128, 2, shuffle=False)
    with pytest.raises(DataError, match="checksum mismatch") as e:
        _iterate(ld)
    assert e.value.file.endswith("shard-000002.tar")
    with pytest.raises(DataError, match="checksum mismatch"):
        build_loader(data, 128, 2, verify="full")  # everything up front


def test_corrupt_token_bytes_caught_by_sha256(data):
    p = data / "train" / "shard-000000.tar"
    _flip(p, 512 + 200)  # inside the first sample's token data
    with pytest.raises(DataError, match="sha256") as e:
        _iterate(build_loader(data, 128, 2, shuffle=False))
    assert e.value.key == "sha256" and e.value.file.endswith("shard-000000.tar")


def test_skip_corrupt_logs_each_and_count(data, caplog):
    _flip(data / "train" / "shard-000002.tar", 10)
    (data / "train" / "shard-000004.tar").unlink()
    with caplog.at_level(logging.WARNING, logger="halo_dist.data"):
        ld = build_loader(data, 128, 2, skip_corrupt=True, max_epochs=1)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("shard-000002.tar" in m for m in msgs) and any("shard-000004.tar" in m for m in msgs)
    assert any("skipped 2 of" in m for m in msgs)
    assert len(ld.skipped_shards) == 2
    assert len(list(ld)) == len(ld) > 0


def _tar(path, members):
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


def _npy(arr):
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def test_sample_without_tokens(tmp_path):
    p = tmp_path / "s.tar"
    _tar(p, [("a.tokens.npy", _npy(np.arange(5, dtype=np.uint32))), ("b.json", b"{}"),
             ("c.tokens.npy", _npy(np.arange(3, dtype=np.uint32)))])
    with pytest.raises(DataError, match="no 'tokens.npy'") as e:
        scan_shard(p)
    assert e.value.key == "b" and e.value.file == str(p)
    q = tmp_path / "e.tar"
    _tar(q, [("a.tokens.npy", _npy(np.zeros(0, np.uint32)))])
    with pytest.raises(DataError, match="empty token array"):
        scan_shard(q)
    r = tmp_path / "n.tar"
    _tar(r, [("a.tokens.npy", b"not an array at all")])
    with pytest.raises(DataError, match="not a .npy"):
        build_loader([r], 4, 1)


def test_manifest_counts_disagree(data):
    m = _manifest(data)
    m["splits"]["train"]["shards"][1]["tokens"] += 7
    _write_manifest(data, m)
    with pytest.raises(DataError, match="manifest says") as e:
        _iterate(build_loader(data, 128, 2, shuffle=False))
    assert e.value.key == "tokens" and e.value.file.endswith("shard-000001.tar")
    m["splits"]["train"]["shards"][1]["tokens"] -= 7
    m["splits"]["train"]["shards"][1]["samples"] += 1
    _write_manifest(data, m)
    with pytest.raises(DataError) as e:
        build_loader(data, 128, 2, verify="full")
    assert e.value.key == "samples"


def test_manifest_checksum_disagrees(data):
    m = _manifest(data)
    m["splits"]["train"]["shards"][0]["sha256"] = "0" * 64
    _write_manifest(data, m)
    with pytest.raises(DataError, match="sha256") as e:
        build_loader(data, 128, 2, verify="full")
    assert e.value.key == "sha256" and e.value.file.endswith("shard-000000.tar")


def test_bad_manifests(data, tmp_path):
    m = _manifest(data)
    del m["splits"]["train"]["shards"][0]["sha256"]
    _write_manifest(data, m)
    with pytest.raises(DataError) as e:
        build_loader(data, 128, 2)
    assert e.value.key == "splits.train.shards[0].sha256" and e.value.file.endswith("manifest.json")
    (data / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        build_loader(data, 128, 2)
    m = _manifest(wiki_dataset())
    m["complete"] = False
    _write_manifest(data, m)
    with pytest.raises(DataError, match="incomplete") as e:
        build_loader(data, 128, 2)
    assert e.value.key == "complete"
    with pytest.raises(DataError, match="manifest not found"):
        build_loader(tmp_path / "nowhere" / "manifest.json", 128, 2)
    with pytest.raises(DataError, match="split 'valid'"):
        build_loader(wiki_dataset(), 128, 2, split="valid")


def test_empty_shard_list(data):
    with pytest.raises(DataError, match="empty shard list"):
        build_loader([], 128, 2)
    m = _manifest(data)
    m["splits"]["train"]["shards"] = []
    _write_manifest(data, m)
    with pytest.raises(DataError, match="no shards") as e:
        build_loader(data, 128, 2)
    assert e.value.key == "splits.train.shards"
    with pytest.raises(DataError, match="matched no files"):
        build_loader(str(data / "nothing-*.tar"), 128, 2)


def test_too_small_for_one_step():
    with pytest.raises(DataError, match="too small"):
        build_loader(wiki_dataset(), 4096, 8, dp_size=4)


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", unk_token="<unk>")


def test_tokenizer_mismatch():
    d = wiki_dataset()
    check_tokenizer(d, qwen_tokenizer(), eos_id=151643)
    with pytest.raises(DataError, match="tokenizer mismatch") as e:
        check_tokenizer(d / "manifest.json", _tiny_tokenizer())
    assert e.value.key == "tokenizer.vocab_sha256" and e.value.file.endswith("manifest.json")
    with pytest.raises(DataError, match="EOS mismatch") as e:
        check_tokenizer(d, qwen_tokenizer(), eos_id=151645)
    assert e.value.key == "tokenizer.eos_id"
    with pytest.raises(DataError, match="tokenizer mismatch"):
        build_loader(d, 128, 2, tokenizer=_tiny_tokenizer())


def test_atomic_writes_never_clobber(tmp_path):
    p = tmp_path / "shard-000000.tar"
    p.write_bytes(b"precious")
    with pytest.raises(RuntimeError):
        with ShardWriter(p) as w:
            w.add(0, 0, 1, np.arange(10, dtype=np.uint32))
            raise RuntimeError("disk full")
    assert p.read_bytes() == b"precious" and sorted(x.name for x in tmp_path.iterdir()) == [p.name]
    q = tmp_path / "new.tar"
    with pytest.raises(RuntimeError):
        with ShardWriter(q) as w:
            raise RuntimeError("boom")
    assert not q.exists() and sorted(x.name for x in tmp_path.iterdir()) == [p.name]
    j = tmp_path / "m.json"
    atomic_write_json(j, {"a": 1})
    with pytest.raises(TypeError):
        atomic_write_json(j, {"a": object()})
    assert (json.loads(j.read_text()) == {"a": 1}
            and sorted(x.name for x in tmp_path.iterdir()) == ["m.json", p.name])


def test_verify_share_splits_the_shards_over_ranks_and_names_the_bad_one(data):
    from halo_dist.data import resolve_shards, verify_share

    shards, _ = resolve_shards(data)
    _flip(data / "train" / "shard-000002.tar", 512 + 200)
    found = [verify_share(data, "train", rank, 3) for rank in range(3)]
    assert ([len(f) for f in found] == [0, 0, 1] and "shard-000002.tar" in found[2][0]
            and "sha256" in found[2][0])
    assert len(shards) > 3  # every rank had a share; together they cover each shard once
