"""data_prep.retrieval: synthetic long-range retrieval documents that share nothing with the NIAH
evaluation's prompts."""

import json
import random
import re

from data_prep import retrieval as R
from halo_dist.eval import niah

FILLER = [f"Paragraph {i} of the filler says something plain about topic {i % 7}." * 3
          for i in range(400)]


def _facts(doc: str) -> dict[tuple[str, str], list[tuple[int, str]]]:
    """(entity, attribute) -> [(position, value)] of every fact and recall line in ``doc``."""
    out: dict = {}
    patterns = [t.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?").replace(".", r"\.")
                .format(entity="(?P<e>.+?)", attr="(?P<a>[a-z ]+?)", value="(?P<v>[^ ]+?)")
                for t in R.FACTS + R.RECALLS]
    for i, line in enumerate(doc.split("\n\n")):
        for p in patterns:
            if m := re.fullmatch(p, line[0].lower() + line[1:]) or re.fullmatch(p, line):
                out.setdefault((m["e"].lower(), m["a"]), []).append((i, m["v"].rstrip(".")))
                break
    return out


def test_facts_come_before_their_recalls_with_the_same_value_at_every_distance():
    docs = list(R.generate(FILLER, docs=3, chars=60_000, seed=5))
    assert docs == list(R.generate(FILLER, docs=3, chars=60_000, seed=5))  # deterministic
    distances = []
    for doc in docs:
        assert len(doc) >= 60_000
        facts = _facts(doc)
        assert len(facts) >= 20  # one per 2,000 characters, a few repeats dropped
        for (entity, attr), seen in facts.items():
            (first, value), *rest = seen
            assert rest and all(v == value and at > first for at, v in rest), (entity, seen)
            distances += [at - first for at, _ in rest]
    # recalls reach across the whole document (the paragraphs are ~200 characters)
    assert max(distances) > 200 and min(distances) < 50


def test_no_template_name_or_haystack_of_the_niah_evaluation():
    docs = "\n".join(R.generate(FILLER, docs=5, chars=20_000, seed=1))
    assert "special magic" not in docs and "mentioned in the provided text" not in docs
    assert not any(f"{w}-{n}" in docs for w in niah.KEY_WORDS for n in niah.KEY_NOUNS)
    assert niah.FILLER.split(".")[0] not in docs
    uuid = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}")
    assert not uuid.search(docs)
    rng = random.Random(0)
    kinds = {re.sub(r"[0-9]", "9", re.sub(r"[A-Z]", "A", R.value(rng))) for _ in range(300)}
    assert len(kinds) > 8  # numbers of several lengths, codes, word triples, dates
    assert "9999999" not in kinds  # a 7-digit number is the NIAH needle's format
    assert not re.search(r"(?<![0-9/-])[0-9]{7}(?![0-9/-])", docs)


def test_cli_writes_jsonl_and_refuses_bad_arguments(tmp_path, capsys):
    filler = tmp_path / "filler.jsonl"
    filler.write_text("".join(json.dumps({"text": t}) + "\n" for t in FILLER))
    out = tmp_path / "r.jsonl"
    assert R.main(["--filler", str(filler), "--out", str(out), "--docs", "2", "--chars",
                   "5000"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(r["source"] == "retrieval" for r in rows)
    assert R.main(["--filler", str(tmp_path / "none.jsonl"), "--out", str(out)]) == 2
    assert "no such file" in capsys.readouterr().err
    assert R.main(["--filler", str(filler), "--out", str(out), "--chars", "10"]) == 2
