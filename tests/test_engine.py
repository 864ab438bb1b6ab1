"""The HALO engine end to end on CPU: launchers in subprocesses, gloo ranks.

Each scenario runs the real launchers (``python launchers/stageN.py`` / ``torchrun``) on a tiny
random Qwen3 teacher and real Wikipedia shards, both in configs/tiny's 4,096-token BPE vocabulary.
"""

import json
import os
import subprocess
import sys

import pytest
from stage_runs import REPO, TINY, losses, rewrite_in_checkpoint, run_launcher

from halo_dist.train.metrics import read_metrics


@pytest.mark.slow
def test_tiny_pipeline_stage1_2_3_losses_fall_and_export_loads(shards, tmp_path):
    s1, s2, s3 = tmp_path / "s1", tmp_path / "s2", tmp_path / "s3"
    run_launcher("stage1", s1, f"data.train={shards}", "schedule.total_steps=10",
                 "eval.every_steps=5", "eval.rows=4")
    l1 = losses(s1)
    assert l1[-1] < 0.7 * l1[0], l1
    mse = read_metrics(s1)["eval/mse"]  # held-out curve: before training, every 5 steps, at the end
    assert [s for s, _ in mse] == [0, 5, 10] and mse[-1][1] < mse[0][1], mse
    assert (s1 / "final" / "rnn_layers.safetensors").exists() and (s1 / "config.yaml").exists()
    run_launcher("stage2", s2, f"data.train={shards}", f"model.stage1_weights={s1 / 'final'}",
                 "schedule.total_steps=8", "eval.every_steps=4", "eval.rows=4")
    l2 = losses(s2)
    assert l2[-1] < l2[0], l2
    m2 = read_metrics(s2)
    assert ([s for s, _ in m2["eval/kl"]] == [0, 4, 8]
            and m2["eval/kl"][-1][1] < m2["eval/kl"][0][1]), m2["eval/kl"]
    # a random teacher over the 4,096-token vocabulary: ~ln(4096) = 8.3
    assert all(v > 5.0 for _, v in m2["eval/teacher_ce"])
    assert all(v > 0 for _, v in m2["eval/ce"])
    # KL inside the first 32 positions of each document, CE beyond (loss.kl_max_position)
    run_launcher("stage3", s3, f"data.train={shards}", f"model.student_init={s2 / 'final'}",
                 "schedule.total_steps=3", "loss.kl_max_position=32")
    assert (s3 / "final" / "modeling_hypenet.py").exists()
    # the export records its recipe: every stage before it with its steps, tokens and last held-out
    # figures
    record = json.loads((s3 / "final" / "halo_dist.json").read_text())
    assert record["stage"] == "stage3" and record["step"] == 3 and record["tokens"] > 0
    assert [h["stage"] for h in record["history"]] == ["convert", "stage1", "stage2"]
    _, stage1, stage2 = record["history"]
    assert stage1["step"] == 10 and stage1["eval"]["eval/mse"] == mse[-1][1]
    assert (stage2["step"] == 8 and stage2["tokens"] > 0
            and stage2["eval"]["eval/kl"] == m2["eval/kl"][-1][1])
    card = (s3 / "final" / "README.md").read_text()
    assert "stage 2: end-to-end distillation" in card and f"{stage2['eval']['eval/kl']:.4f}" in card
    # stage 3's CE-only objective (the reference code's choice) runs without a teacher forward
    run_launcher("stage3", tmp_path / "s3ce", f"data.train={shards}",
                 f"model.student_init={s2 / 'final'}", "schedule.total_steps=3",
                 "loss.objective=ce", "checkpoint.every_steps=0", "logging.profile_at_step=2",
                 "logging.profile_steps=2")
    assert losses(tmp_path / "s3ce")[0] > 1.0  # next-token CE over the vocabulary, not a KL
    # the profiler window (steps 2-3) wrote its summary and trace
    prof = json.loads((tmp_path / "s3ce" / "profile" / "summary.json").read_text())
    assert prof["steps"] == [2, 3] and prof["wall_ms_per_step"] > 0 and prof["top_host"]
    assert (tmp_path / "s3ce" / "profile" / "trace.json").stat().st_size > 0
    # the stage-3 output is a self-contained HF folder; the checkpoint holds no teacher
    ckpt = next((s3 / "checkpoints").glob("step-*"))
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == 3
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(s3 / "final", trust_remote_code=True)
    assert model.config.attn_layers == [1]
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3)
    assert out.shape == (1, 6)
    # stage-2 checkpoints export to the same model the stage wrote (ZeRO-3 shards consolidated)
    from halo_dist.train.export_checkpoint import export_checkpoint

    exported = export_checkpoint(s2 / "checkpoints", tmp_path / "exported")
    a = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True)
    b = AutoModelForCausalLM.from_pretrained(s2 / "final", trust_remote_code=True)
    for (ka, va), (kb, vb) in zip(sorted(a.state_dict().items()), sorted(b.state_dict().items())):
        assert ka == kb and torch.allclose(va, vb), ka


@pytest.mark.slow
def test_two_rank_zero3_matches_one_rank(shards, tmp_path):
    """Same global batch (4 rows): 1 rank x 2 accumulation steps vs 2 ranks x 1, ZeRO-3 on gloo."""
    common = [f"data.train={shards}", "model.stage1_weights=null", "schedule.total_steps=4",
              "parallel.zero_stage=3", "eval.every_steps=2", "eval.rows=8"]
    one = run_launcher("stage2", tmp_path / "one", *common)
    two = run_launcher("stage2", tmp_path / "two", *common, nproc=2)
    # the start line states the layout; ZeRO-3's gathers use torch's current collective
    # names:
    # DeepSpeed's deprecated all_gather_into_tensor/reduce_scatter_tensor warned ~2x per step
    # (deepspeed_setup.py)
    assert ("layout: world 1 = dp 1 x sp 1; global batch 4 = micro 2 x grad_accum 2 x dp "
            "1" in one.stdout)
    assert ("layout: world 2 = dp 2 x sp 1; global batch 4 = micro 2 x grad_accum 1 x dp "
            "2" in two.stdout)
    assert "FutureWarning" not in two.stdout + two.stderr, two.stderr[-3000:]
    # micro 4 does not fit 4 rows over 2 ranks: data.fit_micro_batch runs micro 2, the same global
    # batch
    res = run_launcher("stage2", tmp_path / "sharded", *common, "parallel.teacher_placement=zero3",
                       "data.micro_batch_size=4", "data.fit_micro_batch=true", nproc=2)
    assert "micro batch 4 -> 2 on 2 ranks" in res.stdout
    # the resolved config says so
    assert "micro_batch_size: 2" in (tmp_path / "sharded" / "config.yaml").read_text()
    one, two, sharded = (losses(tmp_path / "one"), losses(tmp_path / "two"),
                         losses(tmp_path / "sharded"))
    assert len(one) == len(two) == len(sharded) == 4
    for a, b, c in zip(one, two, sharded):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (one, two)
        # a ZeRO-3-sharded teacher is the same teacher
        assert abs(a - c) <= 1e-4 * max(1.0, abs(a)), (one, sharded)
    # held-out evaluation: the same 8 rows, split over 2 ranks, summed over the world
    for tag in ("eval/kl", "eval/ce", "eval/teacher_ce"):
        curves = [read_metrics(tmp_path / run)[tag] for run in ("one", "two", "sharded")]
        assert [s for s, _ in curves[0]] == [0, 2, 4], curves[0]
        for (_, a), (_, b), (_, c) in zip(*curves):
            assert (abs(a - b) <= 1e-4 * max(1.0, abs(a))
                    and abs(a - c) <= 1e-4 * max(1.0, abs(a))), (tag, curves)


@pytest.mark.slow
def test_sequence_parallel_stage2_matches_sp1(shards, tmp_path):
    """Ulysses SP = 2 (attention and Lightning layers, student and teacher) vs SP = 1 on the same
    data."""
    common = [f"data.train={shards}", "model.stage1_weights=null", "schedule.total_steps=3",
              "data.seq_len=128", "eval.every_steps=3", "eval.rows=2"]
    run_launcher("stage2", tmp_path / "sp1", *common)
    run_launcher("stage2", tmp_path / "sp2", *common, "parallel.sp_size=2", nproc=2)
    sp1, sp2 = losses(tmp_path / "sp1"), losses(tmp_path / "sp2")
    assert len(sp1) == len(sp2) == 3
    for a, b in zip(sp1, sp2):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (sp1, sp2)
    kl1, kl2 = read_metrics(tmp_path / "sp1")["eval/kl"], read_metrics(tmp_path / "sp2")["eval/kl"]
    assert len(kl1) == len(kl2) == 2  # steps 0 and 3; SP ranks each hold half of every held-out row
    for (_, a), (_, b) in zip(kl1, kl2):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (kl1, kl2)


@pytest.mark.slow
def test_crash_and_resume_reproduces_the_loss_curve(shards, tmp_path):
    common = [f"data.train={shards}", "model.stage1_weights=null", "schedule.total_steps=6",
              "checkpoint.every_steps=2", "eval.every_steps=2", "eval.rows=2"]
    run_launcher("stage2", tmp_path / "straight", *common)
    crashed = tmp_path / "crashed"
    run_launcher("stage2", crashed, *common, faults=dict(crash_at=3), expect=17)
    assert [p.name for p in (crashed / "checkpoints").glob("step-*")] == ["step-00000002"]
    res = run_launcher("stage2", crashed, *common)  # a restarted launcher resumes automatically
    assert "resumed from" in res.stdout and "step 2" in res.stdout
    straight, resumed = losses(tmp_path / "straight"), losses(crashed)
    assert len(resumed) == 6
    for a, b in zip(straight, resumed):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (straight, resumed)
    # the held-out curve continues too: step 2 was evaluated before its checkpoint, not again after
    # resume
    kl_straight, kl_resumed = (read_metrics(tmp_path / "straight")["eval/kl"],
                               read_metrics(crashed)["eval/kl"])
    assert [s for s, _ in kl_resumed] == [0, 2, 4, 6]
    assert [v for _, v in kl_straight] == pytest.approx([v for _, v in kl_resumed], rel=1e-6)
    assert res.stdout.count("eval @ step 2 ") == 0 and res.stdout.count("eval @ step 4 ") == 1


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_cleanly(shards, tmp_path):
    common = [f"data.train={shards}", "model.stage1_weights=null", "schedule.total_steps=5",
              "checkpoint.every_steps=0"]
    run_dir = tmp_path / "sig"
    res = run_launcher("stage2", run_dir, *common, faults=dict(sigterm_at=2), expect=0)
    assert "stopped by signal" in res.stderr
    assert [p.name for p in (run_dir / "checkpoints").glob("step-*")] == ["step-00000002"]
    assert (run_dir / "checkpoints" / "step-00000002" / "COMPLETE").exists()
    # another run's settings are refused before anything is built, with the list of differences
    res = run_launcher("stage2", run_dir, *common, "model.attn_layers=0,2", "data.seq_len=96",
                       expect=2)
    assert ("refusing to resume" in res.stderr and "model.attn_layers" in res.stderr
            and "data.seq_len" in res.stderr)
    assert "Traceback" not in res.stderr
    # cadence may change: printed
    res = run_launcher("stage2", run_dir, *common, "checkpoint.keep_last=3")
    assert "with changed settings" in res.stdout and "checkpoint.keep_last: 2 -> 3" in res.stdout
    assert len(losses(run_dir)) == 5


@pytest.mark.slow
def test_nonfinite_loss_stops_with_last_good_checkpoint(shards, tmp_path):
    run_dir = tmp_path / "nan"
    res = run_launcher("stage2", run_dir, f"data.train={shards}", "model.stage1_weights=null",
                       "schedule.total_steps=5", faults=dict(nan_at=3), expect=2)
    assert "non-finite loss at step 3" in res.stderr
    saved = run_dir / "checkpoints" / "step-00000002"
    assert (saved / "COMPLETE").exists()
    # the state is that of step 2: its loader stands before step 3's batch (global batch 4 rows
    # here), and the message names that batch
    state = json.loads((saved / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["loader"]["rows_consumed"] == 2 * 4, state["loader"]
    assert "epoch 0, packed rows 8..11" in res.stderr, res.stderr[-2000:]


@pytest.mark.slow
def test_bad_input_is_refused_with_a_clear_message(shards, tmp_path):
    res = run_launcher("stage2", tmp_path / "a", "data.train=/nonexistent/shards",
                       "model.stage1_weights=null", expect=2)
    assert "error:" in res.stderr and "/nonexistent/shards" in res.stderr
    res = run_launcher("stage2", tmp_path / "b", f"data.train={shards}", "data.micro_batch_size=3",
                       expect=2)
    assert "global_batch_size" in res.stderr
    res = run_launcher("stage2", tmp_path / "c", f"data.train={shards}", "optim.lrr=1", expect=2)
    assert "did you mean 'optim.lr'" in res.stderr
    res = run_launcher("stage2", tmp_path / "d", f"data.train={shards}",
                       "model.stage1_weights=/no/such/stage1", expect=2)
    assert "run stage 1 first" in res.stderr
    res = run_launcher("stage1", tmp_path / "e", f"data.train={shards}",
                       config=TINY / "stage2.yaml", expect=2)
    assert "stage1 launcher" in res.stderr
    # shards of the 4,096-token BPE for a model that embeds 1,000 ids: refused before any model is
    # built
    res = run_launcher("stage2", tmp_path / "f", f"data.train={shards}",
                       "model.stage1_weights=null", "model.random_teacher.vocab_size=1000",
                       expect=2)
    assert ("embeds only 1,000" in res.stderr and "tokenizer.vocab_size" in res.stderr
            and "manifest.json" in res.stderr)
    assert "Traceback" not in res.stderr and "IndexError" not in res.stderr


@pytest.mark.slow
def test_real_smollm2_teacher_refuses_shards_of_another_tokenizer(smollm2_dir, shards, tmp_path):
    """Stage 2 with the real SmolLM2-135M teacher on shards made with another tokenizer
    (configs/tiny's small BPE): refused up front.
    (Stages 1-3 on this teacher and its own shards run end to end in tests/test_demo.py.)"""
    real = [f"model.teacher={smollm2_dir}", "model.random_teacher=null", "model.num_layers=30",
            "model.attn_layers=3,10,17,24"]
    res = run_launcher("stage2", tmp_path / "bad", *real, f"data.train={shards}",
                       "model.stage1_weights=null", expect=None)
    assert res.returncode == 2 and "tokenizer" in res.stderr, res.stderr[-2000:]


@pytest.mark.slow
def test_compiled_layers_train_like_eager_under_zero1_and_checkpointing(shards, tmp_path):
    """model.compile=layer with ZeRO-1 and activation checkpointing, as the 2B stage-2 config runs
    it: the same losses as the eager engine (fp32 CPU, Inductor). ZeRO-3 is refused up front (empty
    parameter shards)."""
    common = [f"data.train={shards}", "model.stage1_weights=null", "schedule.total_steps=3",
              "parallel.zero_stage=1", "parallel.deepspeed_config=configs/deepspeed/zero1.json",
              "model.activation_checkpointing=true"]
    run_launcher("stage2", tmp_path / "eager", *common)
    run_launcher("stage2", tmp_path / "compiled", *common, "model.compile=layer")
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert len(eager) == len(compiled) == 3
    for a, b in zip(eager, compiled):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (eager, compiled)
    refused = run_launcher("stage2", tmp_path / "zero3", f"data.train={shards}",
                           "parallel.zero_stage=3", "model.compile=layer", expect=2)
    assert "model.compile" in refused.stderr and "zero_stage" in refused.stderr


def test_resume_check_sorts_settings_into_refused_and_allowed():
    from halo_dist.train.resume_check import compare

    saved = {"stage": {"name": "stage2"},
             "model": {"teacher": "a", "attn_layers": [1, 3], "compile": "none"},
             "data": {"train": "d", "seq_len": 512, "micro_batch_size": 8, "global_batch_size": 32},
             "optim": {"lr": 1e-4}, "schedule": {"total_steps": 100},
             "loss": {"objective": "kl", "chunk_size": 4096}}
    current = {"stage": {"name": "stage2"},
               "model": {"teacher": "b", "attn_layers": [1, 3], "compile": "layer"},
               "data": {"train": "d", "seq_len": 512, "micro_batch_size": 4,
                        "global_batch_size": 32}, "optim": {"lr": 5e-5},
               "schedule": {"total_steps": 200}, "loss": {"objective": "kl", "chunk_size": 8192}}
    refused, allowed = compare(saved, current)
    assert refused == ["model.teacher: 'a' -> 'b'"]
    assert allowed == ["data.micro_batch_size: 8 -> 4", "loss.chunk_size: 4096 -> 8192",
                       "model.compile: 'none' -> 'layer'", "optim.lr: 0.0001 -> 5e-05",
                       "schedule.total_steps: 100 -> 200"]
    assert compare(saved, saved) == ([], [])


def test_resume_check_covers_the_pretrain_section_and_reads_moved_keys_at_their_place():
    """A pretrain run's variant and shape must match on resume; a checkpoint config that holds them
    under model: (arch, sliding_window, scratch) is compared at pretrain.*, and a null key the other
    side lacks (model.arch: null in a distillation checkpoint's config, pretrain: null in the
    current one) is no difference."""
    from halo_dist.config import load_config, to_dict
    from halo_dist.train.resume_check import compare

    current = to_dict(load_config(TINY / "pretrain_hypenet.yaml"))
    assert current["pretrain"]["arch"] == "hypenet" and "arch" not in current["model"]
    changed = to_dict(load_config(TINY / "pretrain_hypenet.yaml", ["pretrain.model.hidden_size=32",
                                                                   "pretrain.model.init_seed=1"]))
    refused, allowed = compare(current, changed)
    assert (refused == ["pretrain.model.hidden_size: 64 -> 32", "pretrain.model.init_seed: 0 -> 1"]
            and allowed == [])
    swan = to_dict(load_config(TINY / "pretrain_hypenet.yaml",
                               ["pretrain.arch=swan", "model.pe=null"]))
    assert "pretrain.arch: 'hypenet' -> 'swan'" in compare(current, swan)[0]

    saved = json.loads(json.dumps(current))
    section = saved.pop("pretrain")
    saved["model"].update(arch=section["arch"], sliding_window=section["sliding_window"],
                          scratch=section["model"])
    assert compare(saved, current) == ([], [])
    saved["model"]["scratch"]["num_hidden_layers"] = 8
    assert compare(saved, current)[0] == ["pretrain.model.num_hidden_layers: 8 -> 4"]

    distill = to_dict(load_config(TINY / "stage2.yaml"))
    assert distill["pretrain"] is None
    saved = json.loads(json.dumps(distill))
    del saved["pretrain"]
    saved["model"].update(arch=None, sliding_window=None, scratch=None)
    assert compare(saved, distill) == ([], [])


class _Payload:
    """What an attacker would plant in a run folder: unpickling it runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_a_crafted_checkpoint_file_is_refused_and_runs_nothing(shards, tmp_path):
    """DeepSpeed's shards, our RNG files and the export path are read with weights_only=True: a
    model-states file holding a pickled callable stops resume and export with an error naming the
    file."""
    import shutil

    import torch

    run_dir = tmp_path / "run"
    common = [f"data.train={shards}", "model.stage1_weights=null", "schedule.total_steps=3",
              "checkpoint.every_steps=1"]
    run_launcher("stage2", run_dir, *common, faults=dict(crash_at=2), expect=17)
    step = run_dir / "checkpoints" / "step-00000001"
    pristine = tmp_path / "pristine"
    shutil.copytree(step, pristine)
    marker = tmp_path / "PWNED"
    states = next(step.glob("*model_states.pt"))
    rewrite_in_checkpoint(states, lambda p: torch.save({"module": _Payload(marker)}, p))
    res = run_launcher("stage2", run_dir, *common, expect=2)
    assert ("refusing to load" in res.stderr and states.name in res.stderr
            and "Traceback" not in res.stderr)
    export = subprocess.run([sys.executable, "-m", "halo_dist.cli", "export", "--checkpoint",
                             str(step), "--output", str(tmp_path / "export")],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert (export.returncode == 2
            and "error: refusing to load" in export.stderr), export.stderr[-2000:]
    assert "Traceback" not in export.stderr
    assert not marker.exists()  # the payload never ran
    # the untouched checkpoint still resumes and exports through the same safe path
    shutil.rmtree(step)
    shutil.copytree(pristine, step)
    res = run_launcher("stage2", run_dir, *common)
    assert "resumed from" in res.stdout
    ok = subprocess.run([sys.executable, "-m", "halo_dist.cli", "export", "--checkpoint",
                         str(run_dir / "checkpoints"), "--output", str(tmp_path / "export")],
                        capture_output=True, text=True, cwd=REPO, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]


@pytest.mark.slow
def test_a_corrupt_shard_stops_every_rank_before_training(shards, tmp_path):
    """data.verify=full (the default): the two ranks check half of the shards each, before any model
    is built; a shard with one flipped byte (same size, so the size check passes) stops both with
    its name.
    With data.verify=sizes the same run starts, and the shard is refused only when it is first
    read."""
    import shutil

    bad = shutil.copytree(shards, tmp_path / "data")
    victim = sorted((bad / "train").glob("*.tar"))[1]  # rank 1's share
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    victim.write_bytes(bytes(raw))
    res = run_launcher("stage2", tmp_path / "a", f"data.train={bad}", "model.stage1_weights=null",
                       nproc=2, expect=None)
    assert res.returncode != 0
    assert ("data.verify=full found 1 bad shard" in res.stderr
            and victim.name in res.stderr), res.stderr[-3000:]
    assert not (tmp_path / "a" / "checkpoints").exists()
    res = run_launcher("stage2", tmp_path / "b", f"data.train={bad}", "model.stage1_weights=null",
                       "data.verify=sizes", "schedule.total_steps=1", "schedule.warmup_steps=0",
                       "eval.every_steps=0", expect=2)
    assert "data.verify" not in res.stderr and "shards verified" not in res.stdout
    assert victim.name in res.stderr, res.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("zero", [3, 1])
def test_resume_on_another_number_of_ranks_continues_the_curve(shards, tmp_path, zero):
    """A run checkpointed on 2 ranks resumes on 1, and one checkpointed on 1 resumes on 2 (a requeue
    onto another number of GPUs): DeepSpeed's universal checkpoint re-partitions weights and Adam
    moments, and the loss curve equals the 1-rank run's within the 1-vs-2-rank tolerance, the loader
    position exact."""
    import shutil

    common = [f"data.train={shards}", "model.stage1_weights=null", "schedule.total_steps=4",
              "checkpoint.every_steps=2", "checkpoint.keep_last=2", "eval.every_steps=0",
              f"parallel.zero_stage={zero}"]
    ref = tmp_path / "ref"
    run_launcher("stage2", ref, *common)
    resumed = []
    # ZeRO-1 takes the same conversion path: one direction there keeps the suite short
    if zero == 3:
        two_to_one = tmp_path / "two_to_one"
        run_launcher("stage2", two_to_one, *common, nproc=2, faults=dict(sigterm_at=2))
        res = run_launcher("stage2", two_to_one, *common)
        assert "2 ranks -> 1" in res.stdout and "resumed from" in res.stdout, res.stdout[-2000:]
        # the converted copy is removed once loaded
        assert not (two_to_one / "checkpoints" / "universal").exists()
        resumed.append(two_to_one)
    # the reference's own step-2 checkpoint, resumed on 2 ranks
    one_to_two = tmp_path / "one_to_two"
    shutil.copytree(ref, one_to_two)
    shutil.rmtree(one_to_two / "checkpoints" / "step-00000004")
    res = run_launcher("stage2", one_to_two, *common, nproc=2)
    assert "1 rank -> 2" in res.stdout, res.stdout[-2000:]
    curve = losses(ref)
    for run in (*resumed, one_to_two):
        other = losses(run)
        assert len(other) == 4
        for a, b in zip(curve, other):
            assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (curve, other)
        state = json.loads(
            (run / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())
        assert state["loader"]["rows_consumed"] == json.loads(
            (ref / "checkpoints" / "step-00000004"
             / "trainer_state.json").read_text())["loader"]["rows_consumed"]


@pytest.mark.slow
def test_a_resume_with_other_teacher_weights_under_the_same_path_is_refused(shards, tmp_path):
    """The teacher is identified by the content of its files, not its path: after another model is
    saved into the teacher folder, the resume is refused before anything is built and names the
    changed file."""
    from conftest import tiny_qwen3
    from data_fixtures import small_tokenizer
    from safetensors.torch import load_file, save_file

    teacher = tmp_path / "teacher"
    tiny_qwen3(layers=4, vocab=len(small_tokenizer())).save_pretrained(teacher)
    small_tokenizer().save_pretrained(teacher)
    common = [f"data.train={shards}", f"model.teacher={teacher}", "model.random_teacher=null",
              "model.attn_layers=1", "model.stage1_weights=null", "schedule.total_steps=4",
              "checkpoint.every_steps=0", "eval.every_steps=0"]
    run = tmp_path / "run"
    run_launcher("stage2", run, *common, faults=dict(sigterm_at=2))
    state = json.loads((run / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert set(state["teacher_files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    weights = load_file(teacher / "model.safetensors")
    save_file({k: v + 0.01 if v.is_floating_point() else v for k, v in weights.items()},
              teacher / "model.safetensors", metadata={"format": "pt"})
    res = run_launcher("stage2", run, *common, expect=2)
    assert ("the teacher's files differ" in res.stderr
            and "model.safetensors" in res.stderr), res.stderr[-2000:]
    assert "config.json" not in res.stderr.split("differ")[1]  # only the changed file is named
