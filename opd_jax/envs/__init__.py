"""Multi-turn environments and the episodes the rollout engines play in them."""

from opd_jax.envs.codec import TurnCodec
from opd_jax.envs.episodes import EpisodeLimits, TurnBatcher, run_episode
from opd_jax.envs.protocol import (
           EnvError,
           Environment,
           EnvironmentFactory,
           StepResult,
           Turn,
           builtin_environments,
           check_observation,
           check_result,
    episode_factory,
           load_environment,
)
from opd_jax.envs.trajectory import Trajectory

__all__ = ["EnvError", "Environment", "EnvironmentFactory", "EpisodeLimits", "StepResult", "Trajectory", "Turn",
           "TurnBatcher", "TurnCodec", "builtin_environments", "check_observation", "check_result", "episode_factory",
           "load_environment",
           "run_episode"]
