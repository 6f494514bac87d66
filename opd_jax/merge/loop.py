"""`opd-jax merge`: the experts distilled into one student by multi-teacher on-policy distillation.

Per step: prompts from the mix of the experts' domains, G samples each from the student through
the rollout engine, verifier rewards, the student's θ_old log-probs, each row scored by its
domain's teacher, the sharded OPD step, the new weights pushed to the engine. Held-out accuracy
every `eval_every` steps, checkpoints every `checkpoint.every` (exact resume), then the student
exported and the report (base, experts, student, weight-space baselines) written.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import jax

from opd_jax.config import save_config
from opd_jax.config.merge import MergeConfig
from opd_jax.core import make_optimizer
from opd_jax.core.opd_step import DistillBatch, opd_step, score_student
from opd_jax.core.state import PolicyState
from opd_jax.merge.plan import MergePlan, resolve_plan
from opd_jax.merge.report import write_report
from opd_jax.merge.routing import teacher_indices
from opd_jax.merge.teachers import Teachers, build_teachers
from opd_jax.models import save_model
from opd_jax.parallel import (
    batch_shardings,
    initialize_distributed,
    make_mesh,
    shard,
    sharded_scoring,
    sharded_step,
    tree_shardings,
)
from opd_jax.train.build import build_model
from opd_jax.train.checkpoint import Checkpoints
from opd_jax.train.errors import RunError
from opd_jax.train.metrics import MetricsLog, plot_curves
from opd_jax.train.rollouts import RolloutSession


def _name_teachers(metrics: dict[str, float], names: list[str], present: set[int]) -> dict[str, float]:
    """opd/reverse_kl/teacher<k> -> opd/reverse_kl/<name of teacher k>, for the teachers that had
    rows in this batch (the others have no tokens to average over)."""
    prefix = "opd/reverse_kl/teacher"
    out = {}
    for key, value in metrics.items():
        if key.startswith(prefix):
            k = int(key[len(prefix):])
            if k in present:
                out[f"opd/reverse_kl/{names[k]}"] = value
        else:
            out[key] = value
    return out


def merge(config: MergeConfig, *, resume: bool = False, stop_after: int | None = None) -> Path:
    """Run (or, with resume, continue) the configured merge; returns the run directory, which
    holds report.json when the merge ends. Every input is checked before the first step.
    stop_after: end after that step as if killed (checkpoints as configured), for tests."""
    began = time.perf_counter()
    run_dir = Path(config.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    initialize_distributed(config.distributed)
    checkpoints, start = Checkpoints.for_run(run_dir, config.checkpoint.keep, resume)
    plan = resolve_plan(config)
    save_config(config, run_dir / "config.yaml")
    student, tokenizer = build_model(plan.student)
    mesh = make_mesh(config.mesh)
    temperature = config.rollout.temperature or 1.0
    opd_config = dataclasses.replace(config.opd, group_size=config.rollout.samples_per_prompt,
                                     num_teachers=len(plan.teachers), temperature=temperature)
    opd_config.check_batch_size(config.data.prompts_per_step * config.rollout.samples_per_prompt)
    teachers = build_teachers(plan.teachers, config.teachers, student, tokenizer, mesh, opd_config,
                              run_dir / "sglang_logs")
    state = PolicyState.create(student, make_optimizer(config.optimizer))
    meta = None
    if start is not None:
        state, meta = checkpoints.restore(start, state)
    state = shard(state, tree_shardings(state, mesh))
    try:
        session = RolloutSession(rollout=config.rollout, data=plan.data, seed=config.seed, policy=student,
                                 params=state.params, tokenizer=tokenizer, run_dir=run_dir, version=start or 0,
                                 resume=meta)
    except BaseException:
        teachers.close()
        checkpoints.close()
        raise
    phases = dict(meta["wall_time_s"]) if meta else {"setup": 0.0, "train": 0.0}
    phases["setup"] += time.perf_counter() - began
    log = MetricsLog(run_dir, config.steps, start or 0, tensorboard=config.logging.tensorboard,
                     progress_bar=config.logging.progress_bar)
    try:
        state = _train(config, plan, opd_config, state, session, teachers, mesh, log, checkpoints, start or 0,
                       phases, stop_after)
    finally:
        log.close()
        checkpoints.close()
        session.close()
        teachers.close()
    if state is None:  # stopped early (stop_after)
        return run_dir
    if jax.process_index() == 0:
        began = time.perf_counter()
        save_model(state.model(), run_dir / "student", tokenizer)
        if config.logging.plot:
            plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
        phases["export"] = time.perf_counter() - began
        write_report(config, plan, state.model(), tokenizer, phases, run_dir)
    return run_dir


def _train(config: MergeConfig, plan: MergePlan, opd_config, state: PolicyState, session: RolloutSession,
           teachers: Teachers, mesh, log: MetricsLog, checkpoints: Checkpoints, start: int,
           phases: dict[str, float], stop_after: int | None) -> PolicyState | None:
    vocab = state.model().config.vocab_size
    names = plan.teacher_names
    score_fn = step_fn = None
    if start == 0 and config.logging.eval_at_start:
        log.log(0, session.evaluate(0), advance=False)
    for step in range(start, config.steps):
        began = time.perf_counter()
        batch, rollouts, metrics = session.next_batch(step, vocab)
        index = teacher_indices([r.metadata["domain"] for r in rollouts], plan.routes)
        signals = teachers.score(batch, index)
        if step_fn is None:
            score = functools.partial(score_student, temperature=opd_config.temperature,
                                      microbatches=opd_config.microbatches)
            score_fn = sharded_scoring(score, state, batch, mesh)
            example = DistillBatch(rollout=jax.eval_shape(score, state, batch), teacher_index=index, **signals)
            step_fn = sharded_step(functools.partial(opd_step, config=opd_config), state, example, mesh)
        scored = score_fn(state, shard(batch, batch_shardings(batch, mesh)))
        extra = {"teacher_index": index, **signals}
        extra = shard(extra, batch_shardings(extra, mesh))
        state, step_metrics = step_fn(state, DistillBatch(rollout=scored, **extra))
        metrics.update(_name_teachers({k: float(v) for k, v in step_metrics.items()}, names, set(index.tolist())))
        if metrics["nonfinite_inputs"]:
            raise RunError(f"step {step + 1}: {int(metrics['nonfinite_inputs'])} non-finite log-probs or rewards")
        metrics.update(session.refit(state.params, step + 1))
        done = step + 1
        if done % config.logging.eval_every == 0 or done == config.steps:
            metrics.update(session.evaluate(done))
        phases["train"] += time.perf_counter() - began
        log.log(done, metrics)
        if done % config.checkpoint.every == 0 or done == config.steps:
            checkpoints.save(done, state, {**session.state(), "wall_time_s": phases})
        if stop_after is not None and done >= stop_after:
            return None
    return state

