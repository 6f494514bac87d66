"""Typed, validated training configs: YAML plus dotted overrides, errors that name the key."""

from opd_jax.config.load import (
    ConfigError,
    config_changes,
    dump_config,
    fixed_on_resume,
    load_config,
    save_config,
    to_plain,
)
from opd_jax.config.opd_pipeline import ExpertsConfig, MergeConfig, RecipeConfig
from opd_jax.config.reference import explain
from opd_jax.config.schema import (
    AlgorithmSection,
    CheckpointSection,
    DataSection,
    EpisodeSection,
    FreshModel,
    LoggingSection,
    ModelSection,
    RolloutSection,
    SFTSection,
    SourceSpec,
    TrainConfig,
    scoring_temperature,
)

__all__ = ["AlgorithmSection", "CheckpointSection", "ConfigError", "DataSection", "EpisodeSection", "ExpertsConfig", "FreshModel",
           "LoggingSection", "MergeConfig", "ModelSection", "RecipeConfig", "RolloutSection", "SFTSection", "SourceSpec",
           "TrainConfig", "config_changes", "dump_config", "explain", "fixed_on_resume", "load_config", "save_config",
           "scoring_temperature", "to_plain"]
