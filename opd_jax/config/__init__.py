"""Typed, validated training configs: YAML plus dotted overrides, errors that name the key."""

from opd_jax.config.load import ConfigError, load_config, save_config, to_plain
from opd_jax.config.merge import ExpertsConfig, MergeConfig
from opd_jax.config.schema import (
    AlgorithmSection,
    CheckpointSection,
    DataSection,
    FreshModel,
    LoggingSection,
    ModelSection,
    RolloutSection,
    SFTSection,
    SourceSpec,
    TrainConfig,
)

__all__ = ["AlgorithmSection", "CheckpointSection", "ConfigError", "DataSection", "ExpertsConfig", "FreshModel",
           "LoggingSection", "MergeConfig", "ModelSection", "RolloutSection", "SFTSection", "SourceSpec", "TrainConfig",
           "load_config", "save_config", "to_plain"]
