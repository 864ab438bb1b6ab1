"""The tiny OPD configuration of the OPD tests: ``TINY`` (configs/opd/tiny.yaml), ``VOCAB`` (the
tiny teacher's vocabulary) and ``tiny_cfg`` (that config with overrides)."""

from pathlib import Path

from halo_dist.config import load_config

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "opd" / "tiny.yaml"
VOCAB = 320


def tiny_cfg(run_dir, *overrides, set0=None):
    """configs/opd/tiny.yaml with dotlist overrides; ``set0``: field changes of the first prompt
    set."""
    from dataclasses import replace

    cfg = load_config(TINY, [f"logging.run_dir={run_dir}", "logging.tensorboard=false",
                             "logging.log_every=1", "checkpoint.resume=never", *overrides])
    if set0:
        sets = list(cfg.opd.prompt_sets)
        cfg = replace(cfg, opd=replace(cfg.opd, prompt_sets=[replace(sets[0], **set0), *sets[1:]]))
    return cfg
