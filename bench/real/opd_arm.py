"""Experiment arm d of the real conversion: on-policy distillation (OPAL) of the real student after
stage 3, against a teacher-forced control of as many tokens on the same prompts.

Both arms continue the same stage 3 (``--share-stage3-from RUN`` links another run folder's stages
1-3 on this machine) with ``launchers/opd.py`` on one prompt file (``opd_prompts.py``):

  opd             the student writes ``horizon`` tokens after each prompt (no stop at EOS) and the
                  frozen teacher scores them: reverse KL on the student's own tokens (``opd.lmbda``
                  1), the OPD stage as it ships
  teacher_forced  the same prompts drawn in the same order, each followed by its reference
                  continuation cut to the same ``horizon`` tokens (``opd.lmbda`` 0 with
                  ``opd.fixed_full_horizon``): the same loss on tokens the student did not choose

so each trains steps x rollouts x horizon tokens, and what differs between them is whose tokens they
are: the on-policy effect. The horizon is fixed (no doubling: the control would need the on-policy
run's plateaus), and prompt + horizon stays within the teacher's 8,192 trained positions. Then
calibration of ``a`` and the evaluation every run gets; ``compare-runs`` pairs the two arms prompt
by prompt, item by item and row by row.

Sizes: ``PRESETS`` (the config file and the prompts' token range; a CPU rehearsal runs the tiny
one).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.real.opd_prompts import PromptSpec, prompt_file
from bench.real.run_folder import read_json
from halo_dist.pipeline.demo import Demo

REPO = Path(__file__).resolve().parents[2]
# what each arm sets on top of the shared config
ARMS = {"opd": ("opd.lmbda=1",), "teacher_forced": ("opd.lmbda=0", "opd.fixed_full_horizon=true")}


@dataclass(frozen=True)
class ArmPreset:
    config: Path  # the OPD config both arms share (its prompt file's path is filled in per run)
    prompt_tokens: tuple[int, int]  # the prompts' lengths, drawn uniformly


PRESETS = {
    # one H100: prompts of 1K-6K tokens (their facts recalled across up to ~6K tokens), 512-token
    # horizon: every trained position within the teacher's 8,192
    "gpu": ArmPreset(REPO / "configs" / "opd" / "smollm2_arm.yaml", (1024, 6144)),
    "rehearsal": ArmPreset(REPO / "configs" / "opd" / "smollm2_arm_rehearsal.yaml", (96, 192)),
}


def arm_config(preset: ArmPreset, overrides: tuple[str, ...] = ()):
    """The preset's config, typed and validated, with the arm's checks: one jsonl prompt set with
    its completions, a fixed horizon, rollouts that run the whole horizon."""
    from halo_dist.config import ConfigError, load_config

    try:
        cfg = load_config(preset.config, overrides)
    except ConfigError as e:
        raise SystemExit(f"error: {preset.config}: {e}") from None
    opd, sets = cfg.opd, cfg.opd.prompt_sets
    problems = []
    if len(sets) != 1 or sets[0].kind != "jsonl" or not sets[0].completion_field:
        problems.append("one jsonl prompt set with a completion_field (the built prompts)")
    if opd.horizon_start != opd.horizon_max:
        problems.append("opd.horizon_start = opd.horizon_max (a horizon the on-policy KL cannot "
                        "move, so that both arms train as many tokens)")
    if opd.stop_at_eos:
        problems.append("opd.stop_at_eos false (every rollout runs the whole horizon)")
    if problems:
        raise SystemExit(f"error: {preset.config}: the OPD arm needs {'; '.join(problems)}")
    return cfg


def prompt_spec(cfg, preset: ArmPreset) -> PromptSpec:
    """What the prompt file must hold for ``cfg``: as many rows as the set reads, prompts that
    leave room for the horizon, continuations that fill it."""
    opd, s = cfg.opd, cfg.opd.prompt_sets[0]
    room = opd.max_seq_len - opd.horizon_max
    return PromptSpec(count=s.num_prompts, prompt_tokens=preset.prompt_tokens,
                      continuation_tokens=opd.horizon_max,
                      max_prompt_tokens=min(room, s.max_prompt_tokens or room), seed=opd.seed)


def write_config(preset: ArmPreset, prompts: Path, out: Path) -> Path:
    """The preset's config as one file (its bases merged) with the prompt file's path filled in:
    what the arm's OPD step reads, kept in its run folder."""
    import yaml

    from halo_dist.config.loader import load_tree

    tree = load_tree(preset.config)
    tree["opd"]["prompt_sets"][0]["path"] = str(prompts)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# {preset.config} with the built prompts (bench/real/opd_arm.py)\n"
                   + yaml.safe_dump(tree, sort_keys=False))
    return out


def record_arm(run: Path, arm: str, shared_from: str, config: Path, prompts: Path) -> dict:
    """``opd_arm.json``: which arm the run folder is and what it started from; a continuation
    as the other arm is refused (its OPD step would resume the first arm's checkpoints)."""
    path = run / "opd_arm.json"
    started = read_json(path)
    if started and started["arm"] != arm:
        raise SystemExit(f"error: {run} is the OPD arm {started['arm']!r}, not {arm!r}: continue "
                         "it with the same --opd-arm, or give another --tag")
    record = {"arm": arm, "overrides": list(ARMS[arm]), "stages_1_3_from": shared_from or run.name,
              "config": str(config), "prompts": str(prompts)}
    run.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    return record


class ArmDemo(Demo):
    """The pipeline of an arm: stages 1-3 (shared, or run here), then the OPD step of the arm; the
    student it exports is calibrated and evaluated as every run's."""

    def __init__(self, s, opd_cmd: list[str], opd_steps: int):
        super().__init__(s)
        self.opd_cmd, self.opd_steps = opd_cmd, opd_steps

    def student_source(self) -> Path:
        self.run("opd", self.opd_cmd, self.out / "opd" / "final" / "DONE", stage=True)
        self.prune_checkpoints("opd")
        return self.out / "opd" / "final"

    def status(self, names: list[str], t0: float) -> str:
        from halo_dist.pipeline.progress import stage_status

        if names == ["opd"]:
            return stage_status(self.out / "opd", self.opd_steps) or super().status(names, t0)
        return super().status(names, t0)


def arm_demo(a, s, run: Path) -> ArmDemo:
    """The arm ``a.opd_arm`` of the run folder ``run`` (settings ``s``): its prompts (built once
    per work folder), its config and record, and the demo that runs it."""
    preset = PRESETS["rehearsal" if a.cpu_rehearsal else "gpu"]
    cfg = arm_config(preset, ARMS[a.opd_arm])
    name = preset.config.stem
    prompts = prompt_file(a.work / "opd_prompts", prompt_spec(cfg, preset), a.work / "text",
                          a.work / "corpus", a.work / "tokenizer", name)
    config = write_config(preset, prompts, run / "opd.yaml")
    record_arm(run, a.opd_arm, a.share_stage3_from, config, prompts)
    cmd = [sys.executable, str(REPO / "launchers" / "opd.py"), "--config", str(config),
           f"model.student_init={run / 'stage3' / 'final'}", f"logging.run_dir={run / 'opd'}",
           *ARMS[a.opd_arm]]
    return ArmDemo(s, cmd, cfg.schedule.total_steps)


def opd_summary(run: Path) -> dict | None:
    """The arm's OPD step: which arm, its trained tokens and steps (the two arms' must be equal),
    the share of on-policy steps, the divergence on the trained tokens and on held-out rollouts
    (first and last logged), and the mean seconds per step spent generating and training (each
    logged row holds its interval's mean)."""
    import statistics

    from halo_dist.train.metrics import read_metrics

    record = read_json(run / "opd_arm.json")
    if record is None:
        return None
    series = read_metrics(run / "opd") if (run / "opd" / "metrics.jsonl").exists() else {}

    def ends(tag):
        values = series.get(tag)
        return [values[0][1], values[-1][1]] if values else None

    def mean(tag):
        values = [v for _, v in series.get(tag, [])]
        return statistics.mean(values) if values else None

    tokens = series.get("progress/tokens")
    held_out = [t for t in series if t.startswith("eval/")]
    return {**record, "tokens": int(tokens[-1][1]) if tokens else None,
            "steps": int(tokens[-1][0]) if tokens else None,
            "on_policy_share": mean("progress/on_policy"),
            "train_divergence_first_last": ends("train/loss"),
            "heldout_divergence_first_last": ends(held_out[0]) if held_out else None,
            "rollout_seconds_per_step": mean("perf/rollout_time_s"),
            "train_seconds_per_step": mean("perf/train_time_s")}
