"""Typed run configuration: dataclasses, YAML + dotlist loading, validation, resolved dumps.

    from halo_dist.config import load_config
    cfg = load_config("configs/stages/2b/stage2.yaml", ["optim.lr=5e-5"])
    layout = cfg.validate_against_world(world_size)   # batch / SP arithmetic for this job
"""
from .launcher_args import add_config_args, parse_run_args
from .coerce import ConfigError, from_dict, to_dict
from .deepspeed import deepspeed_config, read_deepspeed_json
from .loader import (apply_overrides, config_from_dict, deep_merge, load_config, load_tree,
                     validate_file, with_overrides)
from .resolved import (describe, fit_to_world, format_config, git_info, load_resolved,
                       read_resolved_meta, save_resolved)
from .schema import (PE_ROPE, STAGE_OBJECTIVES, BatchLayout, CheckpointConfig, DataConfig,
                     LoggingConfig, LossConfig, ModelConfig, OptimConfig, ParallelConfig,
                     PretrainConfig, PretrainModelConfig, RandomTeacherConfig, RunConfig,
                     ScheduleConfig, StageConfig)

__all__ = [
    "BatchLayout", "CheckpointConfig", "ConfigError", "DataConfig", "LoggingConfig",
    "LossConfig", "ModelConfig", "OptimConfig", "PE_ROPE", "ParallelConfig", "PretrainConfig",
    "PretrainModelConfig", "RandomTeacherConfig", "RunConfig", "STAGE_OBJECTIVES", "ScheduleConfig",
    "StageConfig", "add_config_args", "apply_overrides", "config_from_dict", "deep_merge",
    "deepspeed_config", "describe", "fit_to_world", "format_config", "from_dict",
    "git_info", "load_config", "load_resolved", "load_tree", "parse_run_args",
    "read_deepspeed_json",
    "read_resolved_meta", "save_resolved", "to_dict", "validate_file", "with_overrides",
]
