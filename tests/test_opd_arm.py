"""Experiment arm d of the real conversion (bench/real/opd_arm.py, opd_prompts.py): the prompts
carry data_prep.retrieval's facts in the corpus's natural training text and nothing of the NIAH
evaluation's; both arms read one prompt file, draw the same prompts and train as many tokens; the
run folder shares another's stages 1-3 only when its settings match; the flags are checked."""

import json
import lzma
import random
import re
import shutil
from argparse import Namespace
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from data_prep.retrieval import FACTS, RECALLS
from data_prep.tokenize import is_heldout
from halo_dist.eval.niah import FILLER, NEEDLE, TEMPLATE
from halo_dist.eval.tokenizers import BYTE_VOCAB, byte_tokenizer

import bench.real_conversion as rc

REPO = Path(__file__).resolve().parents[1]
WORDS = ("river", "lamp", "orchard", "ledger", "window", "tractor", "violin", "pepper", "canal",
         "button", "forest", "kettle", "signal", "harvest", "ribbon", "cabinet")
HELDOUT = 0.3  # the corpus's held-out share in this test (the rehearsal's)


def _doc(tag: str, rng: random.Random) -> str:
    """A document of our own words whose every paragraph names it (``tag``), so that a prompt shows
    which documents its text came from."""
    return "\n\n".join(f"{tag} " + " ".join(rng.choice(WORDS) for _ in range(30)) + "."
                       for _ in range(6))


def _write_pack(folder: Path) -> dict[str, list[str]]:
    """A carried text pack: Wikipedia extracts (the NIAH haystack) first, then our documents, as
    ``bench/build_corpus.py pack`` writes them; returns each source's document tags."""
    rng = random.Random(0)
    folder.mkdir(parents=True)
    tags = {"wiki": [f"WIKI{i}" for i in range(6)], "docs": [f"DOC{i}" for i in range(20)]}
    for n, (source, names) in enumerate(tags.items()):
        with lzma.open(folder / f"{n:02d}-{source}.jsonl.xz", "wt", encoding="utf-8") as f:
            for tag in names:
                f.write(json.dumps({"text": _doc(tag, rng), "source": source}) + "\n")
    return tags


@pytest.fixture()
def work(tmp_path):
    """A work folder as `real_conversion.py corpus` leaves it, for the byte tokenizer: the carried
    text, the tokenizer and the corpus manifest's data_prep arguments."""
    w = tmp_path / "work"
    tags = _write_pack(w / "text")
    byte_tokenizer().save_pretrained(w / "tokenizer")
    (w / "corpus" / "all").mkdir(parents=True)
    (w / "corpus" / "long").mkdir()
    (w / "corpus" / "all" / "manifest.json").write_text(
        json.dumps({"args": {"heldout_fraction": HELDOUT, "seed": 0}}))
    return w, tags


def _niah_pieces() -> list[str]:
    """Every literal piece of the NIAH evaluation's templates, needle and filler sentences."""
    pieces = []
    for text in (TEMPLATE, NEEDLE):
        pieces += [p.strip() for p in re.split(r"\{[a-z_]+\}", text)]
    pieces += [s.strip() + "." for s in FILLER.split(".")]
    return [p for p in pieces if len(p) >= 8]


def test_arm_prompts_recall_data_preps_facts_in_training_text_and_share_nothing_with_niah(work):
    from bench.real.opd_prompts import PromptSpec, build, training_filler

    w, tags = work
    docs = training_filler(w / "text", HELDOUT, 0)
    spec = PromptSpec(count=30, prompt_tokens=(400, 900), continuation_tokens=64,
                      max_prompt_tokens=1000, seed=3)
    rows = build(spec, docs, byte_tokenizer())
    assert len(rows) == 30 and build(spec, docs, byte_tokenizer()) == rows
    assert build(replace(spec, seed=4), docs, byte_tokenizer()) != rows
    # documents 0-5 are the Wikipedia extracts, 6-25 ours; data_prep holds some out
    held = {t for k, t in enumerate(tags["docs"], len(tags["wiki"])) if is_heldout(k, HELDOUT, 0)}
    assert held and set(tags["docs"]) - held
    pieces, seven_digits = _niah_pieces(), re.compile(r"(?<!\d)\d{7}(?!\d)")
    assert any("special magic" in p for p in pieces) and len(pieces) >= 8
    for r in rows:
        text = r["prompt"] + r["completion"]
        # bytes are the tokens; each prompt is cut to its drawn length, within the room
        assert len(r["prompt"].encode()) == r["prompt_tokens"] <= 900
        assert r["completion_tokens"] >= 64
        used = set(re.findall(r"\b(?:WIKI|DOC)\d+\b", text))
        assert used and not used & (held | set(tags["wiki"])), used
        assert not any(p in text for p in pieces) and not seven_digits.search(text)
        # the prompt ends with a recall question of a fact it states; the continuation answers it
        question = r["prompt"].rsplit("\n\n", 1)[1]
        assert r["completion"].startswith(" " + r["answer"])
        assert any(re.fullmatch(_pattern(t.split("{value}")[0]), question, re.I)
                   for t in RECALLS), question
        lines = r["prompt"].split("\n\n")
        assert any(re.fullmatch(_pattern(t, r["answer"]), line, re.I)
                   for t in FACTS for line in lines), r["answer"]


def _pattern(template: str, value: str = "") -> str:
    """A data_prep.retrieval template as a regex: any entity and attribute, the given value."""
    out = re.escape(template.strip())
    for name in ("entity", "attr"):
        out = out.replace(re.escape("{%s}" % name), ".+")
    return out.replace(re.escape("{value}"), re.escape(value))


def _arm_preset(tmp_path: Path):
    """The rehearsal's arm config at byte-tokenizer sizes (a byte is a token)."""
    from bench.real.opd_arm import PRESETS, ArmPreset

    text = PRESETS["rehearsal"].config.read_text()
    text = text.replace("base: ../demo/common.yaml", f"base: {REPO / 'configs/demo/common.yaml'}")
    text = text.replace("max_seq_len: 256", "max_seq_len: 1024")
    text = text.replace("max_prompt_tokens: 240", "max_prompt_tokens: 1000")
    config = tmp_path / "arm.yaml"
    config.write_text(text)
    return ArmPreset(config, (400, 900))


def test_both_arms_read_one_prompt_file_draw_the_same_prompts_and_train_as_many_tokens(
        work, tmp_path, monkeypatch):
    """arm_demo for each arm: one prompt file, the arm's overrides on the shared config, the run's
    own stage 3 as the student; the two arms' curricula draw the same prompts step by step and each
    document trains exactly the horizon's tokens (rollouts run it whole, continuations fill it)."""
    from bench.real import opd_arm
    from halo_dist.config import load_config
    from halo_dist.opd.prompts import Curriculum

    w, _ = work
    monkeypatch.setitem(opd_arm.PRESETS, "rehearsal", _arm_preset(tmp_path))
    built = {}
    for arm, tag in (("opd", "opd_on"), ("teacher_forced", "opd_tf")):
        a = rc.parse_args(["run", "--work", str(w), "--cpu-rehearsal", "--tag", tag, "--opd-arm",
                           arm, "--share-stage3-from", "run"])
        run = rc.run_dir(a)
        demo = opd_arm.arm_demo(a, rc.settings_for(a), run)
        cmd = demo.opd_cmd
        assert cmd[cmd.index("--config") + 1] == str(run / "opd.yaml")
        assert f"model.student_init={run / 'stage3' / 'final'}" in cmd
        assert cmd[-len(opd_arm.ARMS[arm]):] == list(opd_arm.ARMS[arm])
        assert demo.student_source.__func__ is opd_arm.ArmDemo.student_source
        record = json.loads((run / "opd_arm.json").read_text())
        assert (record["arm"], record["stages_1_3_from"]) == (arm, "run")
        built[arm] = load_config(run / "opd.yaml", opd_arm.ARMS[arm])
    paths = {cfg.opd.prompt_sets[0].path for cfg in built.values()}
    assert len(paths) == 1 and Path(paths.pop()).exists()
    tok = byte_tokenizer()
    on = Curriculum(built["opd"].opd, tok, BYTE_VOCAB)
    control = Curriculum(built["teacher_forced"].opd, tok, BYTE_VOCAB,
                         eos_token_id=tok.eos_token_id)
    horizon = built["opd"].opd.horizon_max
    assert built["opd"].opd.stop_at_eos is False and horizon == built["opd"].opd.horizon_start
    for step in range(3):
        fixed = control.sample_fixed(2, step, horizon)
        assert [(n, p) for n, p, _ in fixed] == on.sample(2, step, horizon)
        assert [len(c) for _, _, c in fixed] == [horizon, horizon]
    # a run folder is one arm: continuing it as the other is refused
    a = rc.parse_args(["run", "--work", str(w), "--cpu-rehearsal", "--tag", "opd_on",
                       "--opd-arm", "teacher_forced"])
    with pytest.raises(SystemExit, match="is the OPD arm 'opd', not 'teacher_forced'"):
        opd_arm.arm_demo(a, rc.settings_for(a), rc.run_dir(a))


def test_the_arm_flags_and_config_are_checked(tmp_path):
    from bench.real import opd_arm

    with pytest.raises(SystemExit, match="--opd-arm opd is an experiment: give it a --tag"):
        rc.check_experiment_flags(rc.parse_args(["run", "--work", str(tmp_path), "--opd-arm",
                                                 "opd"]))
    with pytest.raises(SystemExit, match="give one"):
        rc.check_experiment_flags(rc.parse_args(
            ["run", "--work", str(tmp_path), "--tag", "x", "--share-stage1-from", "run",
             "--share-stage3-from", "run"]))
    with pytest.raises(SystemExit):  # argparse: not an arm
        rc.parse_args(["run", "--work", str(tmp_path), "--opd-arm", "greedy"])
    script = (REPO / "bench" / "device_real.sh").read_text()
    assert "${OPD_ARM:+--opd-arm $OPD_ARM}" in script
    assert "${SHARE_STAGE3_FROM:+--share-stage3-from $SHARE_STAGE3_FROM}" in script
    preset = opd_arm.PRESETS["gpu"]
    cfg = opd_arm.arm_config(preset, opd_arm.ARMS["teacher_forced"])
    spec = opd_arm.prompt_spec(cfg, preset)
    assert (spec.continuation_tokens, spec.max_prompt_tokens, spec.count) == (512, 7680, 1040)
    assert spec.max_prompt_tokens + cfg.opd.horizon_max <= 8192  # the teacher's trained positions
    for overrides, why in ((("opd.stop_at_eos=true",), "opd.stop_at_eos false"),
                           (("opd.horizon_start=256",), "horizon_start = opd.horizon_max")):
        with pytest.raises(SystemExit, match=re.escape(why)):
            opd_arm.arm_config(preset, overrides)


def test_an_experiment_shares_stages_1_3_only_when_every_earlier_setting_matches(tmp_path):
    """--share-stage3-from: stage 1's layers, the selection and the stage-2/3 exports become hard
    links in the arm's folder; a setting read before calibration that differs, or a base whose
    stage 3 is not finished, is refused; calibration and evaluation settings may differ."""
    a = Namespace(work=tmp_path, tag="opd_on", cpu_rehearsal=False, results=tmp_path / "res")
    s = rc.preset(a, str(rc.run_dir(a)))
    base = tmp_path / "run"
    for part in ("stage1/final", "stage2/final", "stage3/final"):
        (base / part).mkdir(parents=True)
        (base / part / "model.safetensors").write_bytes(b"w")
    (base / "select").mkdir()
    (base / "select" / "results.json").write_text("{}")
    (base / "select" / "selection.json").write_text('{"attn_layers": [7, 18]}')
    (base / "settings.json").write_text(json.dumps(asdict(s)))
    with pytest.raises(SystemExit, match="holds no finished stage 3"):
        rc.share_stage3(a, s, base)
    (base / "stage3" / "final" / "DONE").write_text("ok")
    (base / "settings.json").write_text(json.dumps({**asdict(s), "stage3_steps": 1}))
    with pytest.raises(SystemExit, match="stage3_steps"):
        rc.share_stage3(a, s, base)
    (base / "settings.json").write_text(json.dumps({**asdict(s), "calib_objective": "retrieval",
                                                    "deadline_s": 520.0}))
    rc.share_stage3(a, s, base)
    arm = tmp_path / "run_opd_on"
    for part in ("stage1", "stage2", "stage3"):
        assert (arm / part / "final" / "model.safetensors").stat().st_nlink == 2
    assert json.loads((arm / "select" / "selection.json").read_text())["attn_layers"] == [7, 18]
    assert not (arm / "stage3" / "metrics.jsonl").exists()  # the arm counts its own steps only
    shutil.rmtree(arm)
    with pytest.raises(SystemExit, match="--tag"):
        rc.share_stage3(Namespace(work=tmp_path, tag=""), s, base)
