"""THE run loop, once, for every algorithm that trains a policy on its own rollouts (PPO in
`opd-jax train`, OPD in `opd-jax merge`, ...). What differs between them is a `Task`:

    run dir, distributed init, checkpoints (refuse to overwrite; resume)      runner
    task.setup(): models, teachers, ...; the state it trains                   task
    state restored, sharded on the mesh; the rollout session                   runner
    per step:  batch → task.extra_inputs → score → step → non-finite check
               → refit → eval → log → checkpoint                               runner (task: the
                                                                               scoring/step fns)
    export, curves, the task's own report                                      task.finish

A new algorithm is a new Task, never a new loop.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol

import jax
from flax import nnx

from opd_jax.config import DataSection, save_config
from opd_jax.models import Decoder, Tokenizer
from opd_jax.parallel import (
    MeshError,
    batch_shardings,
    batch_shards,
    initialize_distributed,
    make_mesh,
    shard,
    sharded_scoring,
    sharded_step,
    tree_shardings,
)
from opd_jax.train.checkpoint import Checkpoints
from opd_jax.train.errors import RunError
from opd_jax.train.metrics import MetricsLog, plot_curves
from opd_jax.train.rollouts import RolloutSession
from rollout_bridge.records import Rollout


class Task(Protocol):
    """The algorithm-specific parts of a run. `setup` is called once, after the run directory and
    its checkpoints are known and before any state exists; the other methods after it."""

    policy: Decoder  # the model the rollout engine serves (its graph; parameters come from the state)
    tokenizer: Tokenizer
    data: DataSection  # the prompts the policy samples on
    scoring_fn: Any  # (state, RolloutBatch) -> RolloutBatch with θ_old filled (pure; the runner jits it)
    step_fn: Any  # (state, step input) -> (state, metrics) (pure; the runner jits it)
    nonfinite_inputs: str  # what the step's "nonfinite_inputs" counts, for the error message

    def setup(self, run_dir: Path, mesh: jax.sharding.Mesh, resuming: bool) -> None: ...

    def create_state(self) -> Any:
        """The train state as a new run starts it (a resumed run restores over it)."""

    def policy_params(self, state: Any) -> nnx.State: ...

    def extra_inputs(self, batch: Any, rollouts: list[Rollout]) -> dict[str, Any]:
        """Per-row arrays the step needs besides the scored batch (teacher scores, ...), on the host."""

    def step_input(self, scored: Any, extra: dict[str, Any]) -> Any: ...

    def name_metrics(self, metrics: dict[str, float], extra: dict[str, Any]) -> dict[str, float]: ...

    def finish(self, state: Any, run_dir: Path, phases: dict[str, float]) -> None:
        """Export and report (process 0 only; the runner calls it after the last step)."""

    def close(self) -> None: ...


def run(config: Any, task: Task, *, resume: bool = False, stop_after: int | None = None) -> tuple[Path, Any]:
    """Run (or, with resume, continue) `task` as `config` (a TrainConfig or MergeConfig: steps,
    seed, mesh, distributed, rollout, checkpoint and logging sections) says; returns the run
    directory and the final state (None when stopped early by `stop_after`, for tests: end after
    that step as if killed, checkpoints as configured)."""
    began = time.perf_counter()
    run_dir = Path(config.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    initialize_distributed(config.distributed)
    checkpoints, start = Checkpoints.for_run(run_dir, config.checkpoint.keep, resume)
    session = None
    try:
        mesh = make_mesh(config.mesh)
        rows = config.data.prompts_per_step * config.rollout.samples_per_prompt
        if rows % batch_shards(mesh):
            raise MeshError(f"{rows} rollouts per step (data.prompts_per_step × rollout.samples_per_prompt) do not "
                            f"split over the mesh's {batch_shards(mesh)} data-parallel shards: use a multiple")
        task.setup(run_dir, mesh, resuming=start is not None)
        save_config(config, run_dir / "config.yaml")
        state, meta = task.create_state(), None
        if start is not None:
            state, meta = checkpoints.restore(start, state)
        state = shard(state, tree_shardings(state, mesh))
        session = RolloutSession(rollout=config.rollout, data=task.data, seed=config.seed, policy=task.policy,
                                 params=task.policy_params(state), tokenizer=task.tokenizer, run_dir=run_dir,
                                 version=start or 0, resume=meta)
        phases = _read_phases(run_dir) if start is not None else {"setup": 0.0, "train": 0.0}
        phases["setup"] += time.perf_counter() - began
        log = MetricsLog(run_dir, config.steps, start or 0, tensorboard=config.logging.tensorboard,
                         progress_bar=config.logging.progress_bar)
        try:
            state = _steps(config, task, state, session, mesh, log, checkpoints, start or 0, phases, stop_after,
                           run_dir)
        finally:
            log.close()
    finally:
        checkpoints.close()
        if session is not None:
            session.close()
        task.close()
    if state is None:
        return run_dir, None
    if jax.process_index() == 0:
        if config.logging.plot:
            plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
        task.finish(state, run_dir, phases)
    return run_dir, state


# Wall time per phase, kept beside the checkpoints (not in them: a checkpoint holds only what the
# computation depends on, so a resumed run's checkpoints equal an uninterrupted run's).
_PHASES = "wall_time.json"


def _read_phases(run_dir: Path) -> dict[str, float]:
    path = run_dir / _PHASES
    return json.loads(path.read_text()) if path.exists() else {"setup": 0.0, "train": 0.0}


def _write_phases(run_dir: Path, phases: dict[str, float]) -> None:
    if jax.process_index() == 0:
        (run_dir / _PHASES).write_text(json.dumps(phases))


def _steps(config: Any, task: Task, state: Any, session: RolloutSession, mesh: jax.sharding.Mesh, log: MetricsLog,
           checkpoints: Checkpoints, start: int, phases: dict[str, float], stop_after: int | None,
           run_dir: Path) -> Any:
    vocab = task.policy.config.vocab_size
    score_fn = step_fn = None
    if start == 0 and config.logging.eval_at_start:
        log.log(0, session.evaluate(0), advance=False)
    for step in range(start, config.steps):
        began = time.perf_counter()
        batch, rollouts, metrics = session.next_batch(step, vocab)
        extra = task.extra_inputs(batch, rollouts)
        if step_fn is None:
            score_fn = sharded_scoring(task.scoring_fn, state, batch, mesh)
            example = task.step_input(jax.eval_shape(task.scoring_fn, state, batch), extra)
            step_fn = sharded_step(task.step_fn, state, example, mesh)
        scored = score_fn(state, shard(batch, batch_shardings(batch, mesh)))
        on_mesh = shard(extra, batch_shardings(extra, mesh)) if extra else extra
        state, step_metrics = step_fn(state, task.step_input(scored, on_mesh))
        metrics.update(task.name_metrics({k: float(v) for k, v in step_metrics.items()}, extra))
        if metrics["nonfinite_inputs"]:
            raise RunError(f"step {step + 1}: {int(metrics['nonfinite_inputs'])} non-finite {task.nonfinite_inputs}")
        metrics.update(session.refit(task.policy_params(state), step + 1))
        done = step + 1
        if done % config.logging.eval_every == 0 or done == config.steps:
            metrics.update(session.evaluate(done))
        phases["train"] += time.perf_counter() - began
        log.log(done, metrics)
        if done % config.checkpoint.every == 0 or done == config.steps:
            checkpoints.save(done, state, session.state())
            _write_phases(run_dir, phases)
        if stop_after is not None and done >= stop_after:
            return None
    return state

