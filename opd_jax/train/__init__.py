"""The imperative shell: THE run loop (`run`, driven by a `Task`), PPO as its task (`train`),
the supervised warm start, checkpoints, metrics, evaluation and the rollout engines.

This is train's public API: the shells above it (`opd_jax.merge`, sweeps, recipes) import from
here and nowhere deeper."""

from opd_jax.run_files import WARM_START, WARM_UP, checkpoint_steps, run_status, write_json
from opd_jax.train.batching import rollout_rewards, trajectories_to_batch
from opd_jax.train.build import add_configured_adapters, build_critic, build_model
from opd_jax.train.checkpoint import Checkpoints
from opd_jax.train.console import progress, say
from opd_jax.train.engines import INITIAL_WEIGHTS, sglang_engine, sglang_server_flags
from opd_jax.train.errors import RunError
from opd_jax.train.evaluate import HeldOutEvaluator, held_out_evaluator
from opd_jax.train.loop import PPOTask, memory_report, train
from opd_jax.train.metrics import read_metrics
from opd_jax.train.preflight import check_engine, check_index_replay, check_run_inputs
from opd_jax.train.rollouts import RolloutSession
from opd_jax.train.run_dir import lock
from opd_jax.train.runner import Task, run
from opd_jax.train.sft import SupervisedTask, supervised_phase, warm_start
from opd_jax.train.signals import stop_if_requested

__all__ = ["Checkpoints", "HeldOutEvaluator", "INITIAL_WEIGHTS", "PPOTask", "RolloutSession", "RunError",
           "SupervisedTask", "Task",
           "WARM_START", "WARM_UP", "add_configured_adapters", "build_critic", "build_model", "check_engine",
           "check_index_replay", "check_run_inputs", "checkpoint_steps",
           "held_out_evaluator", "lock", "memory_report", "progress", "read_metrics", "rollout_rewards", "run", "run_status",
           "say", "sglang_engine", "sglang_server_flags", "stop_if_requested", "supervised_phase", "train",
           "trajectories_to_batch", "warm_start", "write_json"]
