"""An export behaves as transformers and PEFT users expect.

A tiny teacher folder with a chat template and a generation_config.json is converted by ``convert``
(the ``halo-dist convert`` path); the export then runs tests/hf_export_checks.py once in a fresh
process without halo_dist: generate with GenerationConfig defaults and objects, logits processors,
sampling with several return sequences, stop strings, a streamer, scores and a continued cache, beam
search on left-padded rows against an unbatched reference (dynamic and static cache), and a PEFT
LoRA fine-tune.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_qwen3
from hf_export_checks import CHAT_TEMPLATE, CHECKS, TEACHER_GENERATION

from halo_dist.eval.tokenizers import BYTE_VOCAB, byte_tokenizer
from halo_dist.models.convert import convert, convert_model
from halo_dist.models.export import export_hypenet, read_record
from halo_dist.models.model_card import model_card

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from transformers import GenerationConfig

    root = tmp_path_factory.mktemp("hf_export")
    teacher = root / "teacher"
    tiny_qwen3(vocab=BYTE_VOCAB, layers=3).save_pretrained(teacher)
    tok = byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(teacher)
    GenerationConfig(bos_token_id=0, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                     **TEACHER_GENERATION).save_pretrained(teacher)
    convert(str(teacher), [1], root / "export")
    return root / "export"


@pytest.fixture(scope="module")
def fresh_results(export, tmp_path_factory):
    work = tmp_path_factory.mktemp("fresh")
    results = work / "results.json"
    res = subprocess.run([sys.executable, str(HERE / "hf_export_checks.py"), str(export), str(work),
                          str(results)], capture_output=True, text=True, cwd=work, timeout=600)
    assert res.returncode == 0 and results.exists(), res.stderr[-3000:]
    return json.loads(results.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHECKS))
def test_fresh_process_export(fresh_results, name):
    assert fresh_results[name] == "ok", fresh_results[name]


def test_export_carries_the_teachers_chat_template_generation_config_and_a_model_card(export):
    gen = json.loads((export / "generation_config.json").read_text())
    assert ({k: gen[k] for k in TEACHER_GENERATION} == TEACHER_GENERATION
            and gen["eos_token_id"] == 256)
    assert CHAT_TEMPLATE in (export / "chat_template.jinja").read_text()
    record = read_record(export)
    assert (record["stage"] == "convert" and record["attn_layers"] == [1]
            and record["teacher"].endswith("teacher"))
    card = (export / "README.md").read_text()
    assert "attention at layers [1]" in card and "with its chat template" in card
    assert '"repetition_penalty": 1.3' in card and "trust_remote_code=True" in card


def test_an_export_without_tokenizer_says_so(tmp_path):
    out = export_hypenet(convert_model(tiny_qwen3(layers=2), [0]), tmp_path / "bare")
    assert not list(out.glob("tokenizer*"))
    card = (out / "README.md").read_text()
    assert "**This export has no tokenizer.**" in card and "exported without a run record" in card


def test_model_card_lists_each_stage_with_its_tokens_and_evaluation():
    student = convert_model(tiny_qwen3(layers=2), [1])
    record = {"stage": "stage3", "step": 50, "tokens": 3_200, "seq_len": 64,
              "teacher": "Org/Teacher-1B", "eval": {"eval/kl": 0.25}, "history": [
                  {"stage": "convert", "teacher": "Org/Teacher-1B", "attn_layers": [1]},
                  {"stage": "stage1", "step": 10, "tokens": 1_000, "eval": {"eval/mse": 0.5}},
                  {"stage": "stage2", "step": 20, "tokens": 2_000, "eval": {"eval/kl": 0.75}}]}
    card = model_card(student.config, record, tokenizer=True, chat_template=False,
                      generation={"eos_token_id": 1})
    assert "base_model: Org/Teacher-1B" in card and "distilled from Org/Teacher-1B" in card
    for row in ("| 1 | conversion (stage 0)", "| 2 | stage 1:", "| 3 | stage 2:", "| 4 | stage 3:"):
        assert row in card, row
    assert "| 50 | 3,200 | 64 |" in card and "all stages: 6,200." in card
    assert "| stage1 | eval/mse | 0.5000 |" in card and "| stage3 | eval/kl | 0.2500 |" in card
    assert "it has no chat template" in card


@pytest.mark.slow
def test_write_hf_folder_strips_wrapper_prefixes_reties_and_writes_done_last(tmp_path):
    """Trained weights under DeepSpeed's and our stage module's prefixes, without the tied lm_head
    (as a consolidated checkpoint may hold them), become a folder that loads to the same model."""
    import torch
    from transformers import AutoModelForCausalLM

    from halo_dist.models.export import strip_wrapper_prefixes, write_hf_folder

    assert (strip_wrapper_prefixes({"module.student.a": 1, "_orig_mod.b": 2, "student.module.c": 3,
                                    "d": 4})
            == {"a": 1, "b": 2, "c": 3, "d": 4})
    student = convert_model(tiny_qwen3(tie=True, layers=2, vocab=BYTE_VOCAB), [0])
    assert student.config.tie_word_embeddings
    state = {f"module.student.{k}": v.to(torch.bfloat16) for k, v in student.state_dict().items()
             if k != "lm_head.weight"}
    record = {"stage": "stage2", "step": 7, "tokens": 100}
    out = write_hf_folder(state, student.config, tmp_path / "final", tokenizer=byte_tokenizer(),
                          record=record, run_config={"stage": {"name": "stage2"}})
    assert json.loads((out / "DONE").read_text()) == record == read_record(out)
    assert json.loads((out / "run_config.json").read_text()) == {"stage": {"name": "stage2"}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no temp folder left beside it
    loaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    want = {k: v.to(torch.bfloat16).float() for k, v in student.state_dict().items()}
    got = loaded.state_dict()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == torch.float32 and torch.equal(got[key], value), key
    # and it stands alone: a fresh process where halo_dist cannot be imported loads it, tied
    code = ("import sys; sys.modules['halo_dist'] = None; from "
            "transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True); "
            "assert m.lm_head.weight is m.model.embed_tokens.weight; print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


def test_write_hf_folder_names_a_missing_weight_and_writes_nothing(tmp_path):
    from halo_dist.models.export import ExportError, write_hf_folder

    student = convert_model(tiny_qwen3(layers=2), [0])
    state = {f"student.{k}": v
             for k, v in student.state_dict().items() if k != "model.layers.1.mlp.down_proj.weight"}
    # an older complete output
    previous = export_hypenet(student, tmp_path / "final", files={"DONE": "{}"})
    before = sorted((p.name, p.stat().st_mtime_ns) for p in previous.iterdir())
    missing = (r"checkpoint X: missing 1 weight\(s\) of the model: "
               r"model\.layers\.1\.mlp\.down_proj\.weight")
    with pytest.raises(ExportError, match=missing):
        write_hf_folder(state, student.config, tmp_path / "final", record={"stage": "stage2"},
                        source="checkpoint X")
    with pytest.raises(ExportError, match="model.layers.1.mlp.down_proj.weight"):
        write_hf_folder(state, student.config, tmp_path / "fresh", record={"stage": "stage2"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no new folder, no temp folder
    assert sorted((p.name, p.stat().st_mtime_ns) for p in previous.iterdir()) == before


def test_the_model_card_follows_the_final_config(tmp_path):
    """After calibration rewrites ``a`` in config.json the card says the new a;
    attention layers are listed sorted, and stage 1 (which trains an RNN for every layer) lists
    none."""
    from halo_dist.eval.calibrate import write_scale_base

    student = convert_model(tiny_qwen3(layers=4), [3, 1], attn_logits_scale_base=500.0)
    record = {"stage": "stage3", "step": 5, "tokens": 640, "teacher": "Org/T", "history": [
        {"stage": "convert", "teacher": "Org/T", "attn_layers": [3, 1]},
        {"stage": "stage1", "step": 3, "tokens": 384, "attn_layers": [0, 2]},
        {"stage": "stage2", "step": 4, "tokens": 512, "attn_layers": [3, 1]}]}
    out = export_hypenet(student, tmp_path / "student", extra=record)
    assert "a = 500" in (out / "README.md").read_text()
    write_scale_base(out, 50.0)
    card = (out / "README.md").read_text()
    assert "with a = 50." in card, card
    assert "a = 500" not in card and "attention at layers [1, 3]" in card
    rows = {line.split("|")[2].strip()[:7]: line for line in card.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()}
    assert all("attention layers [1, 3]" in rows[stage] for stage in ("convers", "stage 2"))
    assert "attention layers" not in rows["stage 1"], rows["stage 1"]


TOKENIZER_LOADS = """
import sys
from transformers import AutoTokenizer, PreTrainedTokenizerFast
path = sys.argv[1]
a = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
b = PreTrainedTokenizerFast.from_pretrained(path)
assert a("1, 2, 3")["input_ids"] == b("1, 2, 3")["input_ids"]
print("ok")
"""


def test_the_tokenizer_loads_the_card_names_print_nothing(export, tmp_path):
    """The card's two ways to load the tokenizer (with the folder's config code,
    and without any code) give the same tokenizer in a fresh process and print no warning."""
    card = (export / "README.md").read_text()
    assert ("PreTrainedTokenizerFast.from_pretrained(path)" in card
            and "trust_remote_code=True" in card)
    res = subprocess.run([sys.executable, "-c", TOKENIZER_LOADS, str(export)], capture_output=True,
                         text=True, cwd=tmp_path, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]
    assert "model of type" not in res.stderr and "arning" not in res.stderr, res.stderr
