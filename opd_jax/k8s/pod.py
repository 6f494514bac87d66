"""What every pod of a rendered JobSet runs (`opd-jax k8s run`): the command its config is for,
continued from the run directory's last checkpoint when there is one, so a JobSet restart (a
failed pod, a preempted node) picks the run up where it stopped; a finished run is left as is."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from opd_jax.config import ExpertsConfig, MergeConfig, TrainConfig
from opd_jax.run_files import checkpoint_steps, run_status


def run_in_pod(config: BaseModel, only: str | None = None) -> str:
    """Run (or continue) what `config` describes; what was done, in a line."""
    if isinstance(config, ExpertsConfig):
        from opd_jax.merge import run_experts  # an expert continues from its checkpoints by itself
        return f"experts written to {run_experts(config, only=only)}"
    run_dir = Path(config.logging.run_dir)
    if run_status(run_dir) == "finished":
        return f"{run_dir} is finished already; nothing to do"
    resume = bool(checkpoint_steps(run_dir))
    if isinstance(config, MergeConfig):
        from opd_jax.merge import merge
        return f"merge written to {merge(config, resume=resume)}"
    assert isinstance(config, TrainConfig)
    from opd_jax.train import train
    return f"run written to {train(config, resume=resume)}"
