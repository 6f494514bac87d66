"""THE run loop, once, for every algorithm that trains a policy on its own rollouts (PPO in
`opd-jax train`, OPD in `opd-jax merge`, ...). What differs between them is a `Task`:

    run dir, distributed init, checkpoints (refuse to overwrite; resume)      runner
    task.setup(): models, teachers, ...; the state it trains                   task
    state restored, sharded on the mesh; the rollout session                   runner
    per step:  batch (the session's, or task.supplied_batch) → task.extra_inputs
               → score → step → non-finite check
               → refit → eval → log → checkpoint                               runner (task: the
                                                                               scoring/step fns)
    export, curves, the task's own report                                      task.finish

A new algorithm is a new Task, never a new loop.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opd_jax.config import ConfigError, DataSection, config_changes, dump_config, fixed_on_resume
from opd_jax.core import UpdateConfig
from opd_jax.envs import Trajectory
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
from opd_jax.run_files import checkpoint_steps, latest_checkpoint
from opd_jax.train import signals
from opd_jax.train.batching import packed_for
from opd_jax.train.checkpoint import CheckpointMismatch, Checkpoints
from opd_jax.train.console import say
from opd_jax.train.dump import dump_rollouts
from opd_jax.train.errors import EvaluationStopped, Interrupted, RunDirError, RunError
from opd_jax.train.metrics import MetricsLog, plot_curves, run_summary
from opd_jax.train.rollouts import RolloutSession
from opd_jax.train.run_dir import RunDirectory


class Task:
    """The algorithm-specific parts of a run. `check_inputs` is called first, before anything is
    built or written; `setup` once the run directory is claimed and before any state exists; the
    other methods after it. A task sets the members without a default (command, step_fn, update;
    policy, tokenizer and data by setup at the latest) and implements setup, create_state and
    policy_params; everything else has its default here."""

    command: str  # the CLI command that runs it ("train", "merge", "sft"): the owner of its run directory
    description: str | None = None  # the progress bar's label (default: the command)
    policy: Decoder  # the model the rollout engine serves (its graph; parameters come from the state)
    tokenizer: Tokenizer
    data: DataSection  # the prompts the policy samples on (and the held-out sets)
    step_fn: Callable[[Any, Any], tuple[Any, dict[str, jax.Array]]]  # (state, step input) -> (state, metrics); pure
    update: UpdateConfig  # how the step updates (its splits of the batch, packing)
    # (state, RolloutBatch) -> RolloutBatch with θ_old filled (pure; the runner jits it); None: none
    scoring_fn: Callable[[Any, Any], Any] | None = None
    uses_engine = True  # samples its own rollouts (refits, held-out evaluation); False: every batch is supplied
    replays_routing = False  # a MoE policy trains on the engine's experts: the engine must record them
    replays_indices = False  # a DSA policy attends the keys its engine's indexers chose (index replay)
    nonfinite_inputs = "inputs"  # what the step's non-finite count counts, for the error message

    rows_name = "rollouts"  # what a step's rows are
    rows_key = "data.prompts_per_step × rollout.samples_per_prompt"  # the keys that set rows_per_step

    def rows_per_step(self, config: Any) -> int:
        """Rows of a step's batch (they must split over the mesh's data-parallel shards)."""
        return config.data.prompts_per_step * config.rollout.samples_per_prompt

    def check_inputs(self) -> None:
        """Every input (models, data files, reward function, ...) checked without loading weights:
        a problem raises an OpdJaxError naming the key, file:line or sample."""

    def setup(self, run_dir: Path, mesh: jax.sharding.Mesh, resuming: bool) -> dict[str, float]:
        """Build models (and on a new run, warm-start); returns {phase: wall seconds} of what it timed."""
        raise NotImplementedError

    def create_state(self) -> Any:
        """The train state as a new run starts it (a resumed run restores over it)."""
        raise NotImplementedError

    def policy_params(self, state: Any) -> nnx.State:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        """The policy's vocabulary (token ids of a batch are checked against it)."""
        return self.policy.config.vocab_size

    @property
    def trainer_dtype(self) -> str:
        """The precision the trainer computes in (the engine's is compared with it)."""
        return str(jnp.dtype(self.policy.backbone.compute_dtype))

    def supplied_batch(self, step: int) -> tuple[Any, list[Trajectory], dict[str, float]] | None:
        """A batch the task gives step `step` (0-based) in place of the policy's own rollouts (the
        merge's teacher samples, demonstrations), as (batch, trajectories, metrics); None: the
        rollout session's."""
        return None

    def extra_inputs(self, batch: Any, rollouts: list[Trajectory]) -> dict[str, Any]:
        """Per-row arrays the step needs besides the scored batch (teacher scores, ...), on the host."""
        return {}

    def step_input(self, scored: Any, extra: dict[str, Any]) -> Any:
        return scored

    def dump_fields(self, scored: Any, extra: dict[str, Any]) -> dict[str, Any]:
        """Per-token arrays [B, T] of the step's inputs worth seeing beside each dumped trajectory
        (the step's own, such as the advantages it trained on, come as its "targets/*" metrics)."""
        return {}

    def name_metrics(self, metrics: dict[str, np.ndarray], extra: dict[str, Any]) -> dict[str, float]:
        """The step's metrics (host arrays) as logged, one number per name; a task that keeps
        running statistics across steps (the merge's domain balancing) folds this step's in here."""
        return {k: float(v) for k, v in metrics.items()}

    def check_finite(self, step: int, metrics: dict[str, float]) -> None:
        """RunError when the step's inputs held non-finite numbers."""
        if metrics.get("nonfinite_inputs"):
            raise RunError(f"step {step}: {int(metrics['nonfinite_inputs'])} non-finite {self.nonfinite_inputs}")

    def resume_state(self) -> dict[str, Any]:
        """What a checkpoint must hold of the task's own running statistics (JSON)."""
        return {}

    def restore(self, saved: dict[str, Any]) -> None:
        """Take back `resume_state()`'s dict from the checkpoint a run resumes from."""

    def finish(self, state: Any, run_dir: Path, phases: dict[str, float]) -> None:
        """Export and report (process 0 only; the runner calls it after the last step)."""

    def close(self) -> None:
        """Release what setup acquired (teachers' servers, ...)."""


def run(config: Any, task: Task, *, resume: bool = False, force: bool = False,
        stop_after: int | None = None) -> tuple[Path, Any]:
    """Run (or, with resume, continue) `task` as `config` (a TrainConfig or MergeConfig: steps,
    seed, mesh, distributed, rollout, checkpoint and logging sections) says; returns the run
    directory and the final state (None when stopped early by `stop_after`, for tests: end after
    that step as if killed, checkpoints as configured).

    Before anything is built or written, every input is checked and the run directory claimed
    (locked; see `run_dir`); a resume shows how the config changed and refuses changes it cannot
    honour (`config.resume_fixed`) unless `force`. SIGINT/SIGTERM stop at the next step boundary
    with a checkpoint (`Interrupted`)."""
    began = time.perf_counter()
    initialize_distributed(config.distributed)
    rows = task.rows_per_step(config)
    mesh = make_mesh(config.mesh)
    if rows % batch_shards(mesh):
        raise MeshError(f"{rows} {task.rows_name} per step ({task.rows_key}) do not split over the mesh's "
                        f"{batch_shards(mesh)} data-parallel shards: use a multiple")
    task.check_inputs()
    run_dir = Path(config.logging.run_dir)
    directory = RunDirectory(run_dir, task.command)
    if jax.process_index() == 0:  # one owner per run directory, even when many hosts write into it
        directory.open(resume=resume, check=lambda d: _check_resumable(config, d, force) if resume else None)
    status, details = "failed", {}
    try:
        if not resume:
            directory.record_config(dump_config(config))
        with signals.stop_at_step_boundary():
            run_dir, state, status, details = _run(config, task, run_dir, directory, mesh, resume, stop_after, began)
    except Interrupted as e:
        status, details = "interrupted", {"message": str(e)}
        raise
    except CheckpointMismatch as e:  # a refused resume wrote nothing: the run keeps the status it had
        status, details = "refused", {"error": f"{type(e).__name__}: {e}"}
        raise
    except KeyboardInterrupt:  # a second Ctrl-C: stopped wherever it was, a partial checkpoint removed
        status = "interrupted"
        stopped = Interrupted(f"SIGINT twice: stopped at once; {_continue_hint(run_dir)}", signals.exit_status(),
                              at_once=True)
        details = {"message": str(stopped)}
        raise stopped from None
    except BaseException as e:
        details = {"error": f"{type(e).__name__}: {e}"}
        raise
    finally:
        directory.close(status, **details)
    return run_dir, state


def _continue_hint(run_dir: Path) -> str:
    """How to go on from what the run directory holds now."""
    latest = latest_checkpoint(run_dir) or latest_checkpoint(run_dir.parent)  # a warm start's: its run's
    if latest is not None:
        return f"the latest checkpoint is {latest}; continue with: {_resume_command()}"
    return "no checkpoint yet; to start over, run the same command again"


def _check_resumable(config: Any, directory: RunDirectory, force: bool) -> None:
    latest = (checkpoint_steps(directory.path) or [0])[-1]  # 0: only the warm start has checkpoints
    if latest >= config.steps and directory.manifest.get("status") == "finished":
        raise RunDirError(f"{directory.path} has run {latest} of {config.steps} steps: nothing to resume (raise steps "
                          f"to train further)")
    if latest >= config.steps:  # stopped after its last checkpoint, in the export or report: only they run again
        say(f"{directory.path} trained all {config.steps} steps but did not finish its export: finishing it")
    previous = directory.previous_config()
    if previous is None:
        return
    changes = config_changes(previous, config)
    if not changes:
        return
    shown = "\n".join(f"  {k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())
    fixed = fixed_on_resume(changes, type(config).resume_fixed)
    if fixed and not force:
        raise ConfigError(f"the resumed run's config changes {', '.join(fixed)}, which a resume cannot honour "
                          f"(checkpoint shapes, prompt stream); undo the change, choose another logging.run_dir, or "
                          f"pass --force:\n{shown}")
    say(f"resuming with a changed config (the earlier one stays in {directory.path}/config_history/):\n{shown}")


def _changed_since(config: Any, directory: RunDirectory) -> str:
    """'; ...' naming the config changes since the last attempt that a checkpoint's shapes depend on."""
    previous = directory.previous_config()
    changes = config_changes(previous, config) if previous is not None else {}
    fixed = fixed_on_resume(changes, type(config).resume_fixed)
    kl = changes.get("algorithm.ppo.kl.coef")
    if kl is not None and bool(kl[0]) != bool(kl[1]):  # a coefficient's size may change; zero or not may not
        return (f"; the KL term was turned {'on' if kl[1] else 'off'} since it was saved (algorithm.ppo.kl.coef "
                f"{kl[0]!r} -> {kl[1]!r}), and a run holds its frozen reference policy (the policy as RL began) "
                f"only while the term is on: keep it {'off' if kl[1] else 'on'}, or start a new run")
    if not fixed:
        return " (the model or its optimizer changed since the run started)"
    shown = ", ".join(f"{k} {changes[k][0]!r} -> {changes[k][1]!r}" for k in fixed)
    return f"; the config changed {shown} since it was saved, which no resume can honour, even with --force"


# commands that continue what is left when run again, and take no --resume
_RERUN_CONTINUES = ("recipe", "experts")


def _resume_command() -> str:
    argv = [a for a in sys.argv[1:] if a != "--resume"]
    if argv[:1] and argv[0] in _RERUN_CONTINUES:  # a recipe's merge phase: its command runs again
        return "opd-jax " + " ".join(shlex.quote(a) for a in argv)
    return "opd-jax " + " ".join(shlex.quote(a) for a in argv[:1] + ["--resume"] + argv[1:])


def _run(config: Any, task: Task, run_dir: Path, directory: RunDirectory, mesh: jax.sharding.Mesh, resume: bool,
         stop_after: int | None, began: float) -> tuple[Path, Any, str, dict[str, Any]]:
    checkpoints = Checkpoints(run_dir / "checkpoints", config.checkpoint.keep, say=say)
    session = None
    try:
        phases = _read_phases(run_dir) if resume else {}
        devices = jax.device_count()
        axes = ", ".join(f"{k} {v}" for k, v in mesh.shape.items() if v > 1) or "of one"
        say(f"opd-jax {task.command}: {'resuming' if resume else 'new run in'} {run_dir} on {devices} "
            f"device{'s' if devices > 1 else ''} (mesh {axes})")
        timed = task.setup(run_dir, mesh, resuming=resume) or {}
        _add(phases, "setup", time.perf_counter() - began - sum(timed.values()))  # checks, run dir, models
        for name, seconds in timed.items():
            _add(phases, name, seconds)
        state, meta, start = task.create_state(), None, 0
        if resume and checkpoint_steps(run_dir):  # (none yet: only a warm start was resumed, in setup)
            try:
                start, state, meta = checkpoints.restore_latest(state)
            except CheckpointMismatch as e:
                raise CheckpointMismatch(f"{e}{_changed_since(config, directory)}") from None
            task.restore(meta.get("task", {}))
            say(f"resuming {run_dir} from step {start}")
        if resume:
            directory.record_config(dump_config(config))
        state = shard(state, tree_shardings(state, mesh))
        if task.uses_engine:
            session = RolloutSession(rollout=config.rollout, data=task.data, seed=config.seed, policy=task.policy,
                                     params=task.policy_params(state), tokenizer=task.tokenizer, run_dir=run_dir,
                                     version=start, resume=meta, record_routing=task.replays_routing)
            directory.note(engine=session.mismatch_sources(task.trainer_dtype, replays_routing=task.replays_routing,
                                                           replays_indices=task.replays_indices))
        log = MetricsLog(run_dir, config.steps, start, tensorboard=config.logging.tensorboard,
                         progress_bar=config.logging.progress_bar, description=task.description or task.command)
        try:
            state = _steps(config, task, state, session, mesh, log, checkpoints, start, phases, stop_after, run_dir,
                           unlogged=(meta or {}).get("unlogged"))
        finally:
            log.close()
    finally:
        checkpoints.close()
        if session is not None:
            session.close()
        task.close()
    if state is None:
        return run_dir, None, "interrupted", {"message": f"stopped after step {stop_after} (stop_after)"}
    if jax.process_index() == 0:
        exported, timed = time.perf_counter(), sum(phases.values())
        if config.logging.plot:
            plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
        task.finish(state, run_dir, phases)  # may time its own parts into phases
        _add(phases, "export", time.perf_counter() - exported - (sum(phases.values()) - timed))
        _write_phases(run_dir, phases)
        say(run_summary(run_dir, phases))
    return run_dir, state, "finished", {}


def _add(phases: dict[str, float], name: str, seconds: float) -> None:
    phases[name] = phases.get(name, 0.0) + seconds


@contextlib.contextmanager
def _timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Add the block's wall time to phases[name]."""
    began = time.perf_counter()
    try:
        yield
    finally:
        _add(phases, name, time.perf_counter() - began)


# Wall time per phase, kept beside the checkpoints (not in them: a checkpoint holds only what the
# computation depends on, so a resumed run's checkpoints equal an uninterrupted run's).
_PHASES = "wall_time.json"


def _read_phases(run_dir: Path) -> dict[str, float]:
    path = run_dir / _PHASES
    return json.loads(path.read_text()) if path.exists() else {}


def _write_phases(run_dir: Path, phases: dict[str, float]) -> None:
    if jax.process_index() == 0:
        (run_dir / _PHASES).write_text(json.dumps(phases, indent=1))


def _steps(config: Any, task: Task, state: Any, session: RolloutSession | None, mesh: jax.sharding.Mesh, log: MetricsLog,
           checkpoints: Checkpoints, start: int, phases: dict[str, float], stop_after: int | None,
           run_dir: Path, unlogged: dict[str, float] | None = None) -> Any:
    """The steps from `start`; `unlogged`: the metrics of step `start` that a stop during its
    held-out evaluation kept in the checkpoint instead of the log (evaluated and logged first).
    Without a session (a task that supplies every batch) nothing is refitted or evaluated."""
    compiled: dict[str, Any] = {}
    asked_to_stop = lambda: signals.requested() is not None  # noqa: E731
    sampled = (lambda: session.state()) if session is not None else dict  # what a checkpoint keeps of the session
    if session is not None and start == 0 and config.logging.eval_at_start:
        log.note("held-out evaluation")
        with _timed(phases, "evaluation"):
            try:
                log.log(0, session.evaluate(0, stop=asked_to_stop), advance=False)
            except EvaluationStopped:  # keep the starting point (a warm start's work): step 0, evaluated on resume
                with _timed(phases, "checkpoints"):
                    checkpoints.save(0, state, {**sampled(), "task": task.resume_state()})
                _write_phases(run_dir, phases)
                raise Interrupted(f"{signals.requested()} during the held-out evaluation before the first step: "
                                  f"checkpoint saved (step 0; the evaluation runs on resume); continue with: "
                                  f"{_resume_command()}", signals.exit_status()) from None
    if unlogged is not None and not _evaluated(config, session, log, phases, start, unlogged, asked_to_stop,
                                               advance=False):
        raise Interrupted(f"{signals.requested()} during the held-out evaluation of step {start}: its checkpoint keeps "
                          f"it for the next resume; continue with: {_resume_command()}", signals.exit_status())
    for step in range(start, config.steps):
        began, compiling = time.perf_counter(), not compiled
        if compiling:
            log.note("compiling the step")
        state, metrics = _train_step(config, task, state, session, mesh, compiled, step, run_dir)
        done = step + 1
        _add(phases, "first step (compiles)" if compiling else "steps", time.perf_counter() - began)
        if compiling:
            log.restart_clock()  # the ETA counts from the steps after the compile
        logged = _evaluated(config, session, log, phases, done, metrics, asked_to_stop)
        stop = signals.requested()
        if done % config.checkpoint.every == 0 or done == config.steps or stop:
            with _timed(phases, "checkpoints"):
                checkpoints.save(done, state, {**sampled(), "task": task.resume_state(),
                                               **({} if logged else {"unlogged": metrics})})
            _write_phases(run_dir, phases)
        if stop and not logged:
            raise Interrupted(f"{stop} during the held-out evaluation after step {done} of {config.steps}: checkpoint "
                              f"saved (step {done}; its evaluation runs on resume); continue with: {_resume_command()}",
                              signals.exit_status())
        if stop and done < config.steps:
            step_name = f"{task.description} step" if task.description else "step"
            raise Interrupted(f"{stop} after {step_name} {done} of {config.steps}: checkpoint saved ({step_name} {done}); "
                              f"continue with: {_resume_command()}", signals.exit_status())
        if stop_after is not None and done >= stop_after:
            return None
    return state


def _train_step(config: Any, task: Task, state: Any, session: RolloutSession | None, mesh: jax.sharding.Mesh,
                compiled: dict[str, Any], step: int, run_dir: Path) -> tuple[Any, dict[str, float]]:
    """Step `step` (0-based): its batch (the task's, or the session's rollouts) → extra inputs →
    θ_old scoring → the step → the finiteness check → the refit. `compiled` keeps the sharded,
    jitted scoring and step functions (compiled on the first call)."""
    supplied = task.supplied_batch(step)
    batch, rollouts, metrics = supplied if supplied is not None else session.next_batch(step, task.vocab_size)
    batch = packed_for(batch, task.update, batch_shards(mesh))
    extra = task.extra_inputs(batch, rollouts)
    if not compiled:
        compiled["score"] = None if task.scoring_fn is None else sharded_scoring(task.scoring_fn, state, batch, mesh)
        scored_shape = batch if task.scoring_fn is None else jax.eval_shape(task.scoring_fn, state, batch)
        compiled["step"] = sharded_step(task.step_fn, state, task.step_input(scored_shape, extra), mesh)
    scored = shard(batch, batch_shardings(batch, mesh))
    if compiled["score"] is not None:
        scored = compiled["score"](state, scored)
    on_mesh = shard(extra, batch_shardings(extra, mesh)) if extra else extra
    state, step_metrics = compiled["step"](state, task.step_input(scored, on_mesh))
    # per-token arrays the step used (its advantages, ...): dumped, never logged as metrics
    used = {k.removeprefix("targets/"): step_metrics.pop(k) for k in list(step_metrics) if k.startswith("targets/")}
    if config.logging.dump_rollouts:  # the scored batch is not donated: still whole after the step
        dump_rollouts(run_dir / "rollouts" / f"step_{step + 1:06d}.jsonl", step + 1, rollouts, scored,
                      {**task.dump_fields(scored, on_mesh), **used}, task.tokenizer)
    metrics.update(task.name_metrics({k: np.asarray(v) for k, v in step_metrics.items()}, extra))
    task.check_finite(step + 1, metrics)
    if session is not None:
        metrics.update(session.refit(task.policy_params(state), step + 1))
    return state, metrics


def _evaluated(config: Any, session: RolloutSession | None, log: MetricsLog, phases: dict[str, float], done: int,
               metrics: dict[str, float], stop: Any, *, advance: bool = True) -> bool:
    """Log step `done`'s metrics, with the held-out evaluation on eval steps; False (nothing
    logged) when a stop request ended the evaluation early."""
    if session is not None and (done % config.logging.eval_every == 0 or done == config.steps):
        log.note("held-out evaluation")
        with _timed(phases, "evaluation"):
            try:
                metrics = {**metrics, **session.evaluate(done, stop=stop)}
            except EvaluationStopped:
                return False
    log.log(done, metrics, advance=advance)
    return True
