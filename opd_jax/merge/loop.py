"""`opd-jax merge`: the experts distilled into one student by multi-teacher on-policy
distillation, as a task of the one run loop (`opd_jax.train.run`).

Per step: prompts from the mix of the experts' domains, G samples each from the student through
the rollout engine, verifier rewards, the student's θ_old log-probs, each row scored by its
domain's teacher, the sharded OPD step, the new weights pushed to the engine. Held-out accuracy
every `eval_every` steps, checkpoints every `checkpoint.every` (exact resume), then the student
exported and the report (base, experts, student, weight-space baselines) written. With
`teacher_samples`, the teachers' own samples first (a pool, `teacher_samples.py`): a supervised
warm-up on them, and GKD's mixture (a share of the steps trains on the pool instead).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from opd_jax.config import MergeConfig, ModelSection, scoring_temperature
from opd_jax.core import (
    PER_TEACHER_KL,
    DistillBatch,
    PolicyState,
    balance_weights,
    make_optimizer,
    opd_step,
    running_divergence,
    score_student,
)
from opd_jax.envs import Trajectory
from opd_jax.merge.plan import MergeError, MergePlan, resolve_plan
from opd_jax.merge.report import write_report
from opd_jax.merge.routing import teacher_indices
from opd_jax.merge.teacher_samples import TeacherPool, draw_pool, pool_rows, pool_step, write_pool
from opd_jax.merge.teachers import Teachers, build_teachers
from opd_jax.models import Decoder, export_model
from opd_jax.models.grow import grow
from opd_jax.train import (
    WARM_UP,
    SupervisedTask,
    Task,
    add_configured_adapters,
    build_model,
    check_index_replay,
    check_run_inputs,
    checkpoint_steps,
    run,
    say,
    supervised_phase,
)


class OPDTask(Task):
    """The student (the experts' base unless the config names one), its teachers (local on the
    mesh, or SGLang servers), `opd_step`; at the end the student and the report."""

    command = "merge"
    nonfinite_inputs = "log-probs or rewards"
    teachers: Teachers | None = None

    def __init__(self, config: MergeConfig):
        self.config = config
        self.plan: MergePlan = resolve_plan(config)
        self.data = self.plan.data
        self.temperature = scoring_temperature(config.rollout)
        opd = config.opd
        group = config.rollout.samples_per_prompt
        self.update = opd.update
        self.replays_routing = opd.routing_replay == "r3"
        self.replays_indices = opd.index_replay
        self.scoring_fn = functools.partial(score_student, temperature=self.temperature,
                                            microbatches=opd.update.microbatches, routing_replay=self.replays_routing,
                                            index_replay=self.replays_indices)
        names = self.plan.teacher_names
        unknown = sorted(set(config.divergence_by_teacher) - set(names))
        if unknown:
            raise MergeError(f"divergence_by_teacher names {', '.join(unknown)}, which are not teachers ({', '.join(names)})")
        self.step_fn = functools.partial(opd_step, config=opd, group_size=group, num_teachers=len(names),
                                         temperature=self.temperature,
                                         divergences=tuple(config.divergence_by_teacher.get(n, opd.divergence) for n in names))
        self.running = np.full(len(names), np.nan, np.float32)  # each teacher's running divergence (balancing)
        self.pool: TeacherPool | None = None
        self.pool_step = False  # this step trains on the teachers' samples (GKD's mixture)

    def check_inputs(self) -> None:
        models = {"student": self.plan.student}
        if self.config.teachers.engine == "local":
            models.update({f"teachers.paths.{t.name}": ModelSection(path=str(t.path)) for t in self.plan.teachers})
        student = check_run_inputs(mesh=self.config.mesh, models=models, data=self.data,
                                   max_new_tokens=self.config.rollout.max_new_tokens, rollout=self.config.rollout)
        check_index_replay("opd.index_replay", self.replays_indices, self.config.rollout, student)

    def setup(self, run_dir: Path, mesh: jax.sharding.Mesh, resuming: bool) -> dict[str, float]:
        self.policy, self.tokenizer = build_model(self.plan.student)
        # a GGUF student's architecture is known only now
        check_index_replay("opd.index_replay", self.replays_indices, self.config.rollout, self.policy.config)
        growth = self.config.grow
        if growth.num_layers or growth.intermediate_size:
            self.policy = grow(self.policy, num_layers=growth.num_layers, intermediate_size=growth.intermediate_size,
                               noise=growth.noise, seed=self.config.seed)
        self.policy = add_configured_adapters(self.policy, self.plan.student, self.config.seed)  # a LoRA student
        timed = {}
        if self.config.teacher_samples.enabled:
            began = time.perf_counter()
            self.pool = draw_pool(self.config, self.plan, self.tokenizer, self.policy)
            write_pool(self.pool, self.plan.teacher_names, self.tokenizer, run_dir / "teacher_samples.jsonl")
            say("teachers' samples: " + ", ".join(f"{d} {self.pool.kept[d]}/{n}" for d, n in self.pool.drawn.items())
                + " kept")
            timed["teacher samples"] = time.perf_counter() - began
            if self.config.teacher_samples.warmup.steps and not (resuming and checkpoint_steps(run_dir)):
                began = time.perf_counter()
                self.policy = self.warm_up(mesh, run_dir)
                timed["warm-up"] = time.perf_counter() - began
        began = time.perf_counter()
        self.teachers = build_teachers(self.plan.teachers, self.config.teachers, self.policy, self.tokenizer, mesh,
                                       self.config.opd, self.temperature, run_dir / "sglang_logs")
        return {**timed, "teachers": time.perf_counter() - began}

    def warm_up(self, mesh: jax.sharding.Mesh, run_dir: Path) -> Decoder:
        """MOPD's supervised warm-up: cross-entropy on the teachers' pooled samples (all domains)."""
        section, pad = self.config.teacher_samples.warmup, self.tokenizer.pad_token_id or 0
        size = len(self.pool.trajectories)

        def batches(step: int):
            return self.pool.batch(pool_rows(size, section.batch_size, self.config.seed, step, warmup=True), pad)[0]
        task = SupervisedTask(section, batches, self.policy, self.tokenizer, self.data,
                              description="warm-up on the teachers' samples")
        return supervised_phase(self.config, task, run_dir / WARM_UP)

    def create_state(self) -> PolicyState:
        return PolicyState.create(self.policy, make_optimizer(self.config.optimizer, compute_dtype=self.trainer_dtype))

    def policy_params(self, state: PolicyState):
        return state.params

    def supplied_batch(self, step: int) -> tuple[Any, list[Trajectory], dict[str, float]] | None:
        """On GKD's pool steps (probability teacher_samples.fraction), a batch of the teachers' own
        samples in place of the student's."""
        section = self.config.teacher_samples
        self.pool_step = pool_step(section.fraction, self.config.seed, step)
        if not self.pool_step:
            return None
        rows = self.config.data.prompts_per_step * self.config.rollout.samples_per_prompt
        batch, trajectories, _ = self.pool.batch(pool_rows(len(self.pool.trajectories), rows, self.config.seed, step),
                                                 self.tokenizer.pad_token_id or 0)
        # the teachers' samples have no engine choices to replay: -1, the student routes and picks its keys
        # itself (filled, not left out, so a pool step runs the program the other steps compiled)
        student = self.policy.config
        if self.replays_routing:
            batch = batch.replace(routing=np.full((*batch.tokens.shape, len(student.moe_layers),
                                                   student.moe.experts_per_token), -1, np.int32))
        if self.replays_indices:
            batch = batch.replace(indices=np.full((*batch.tokens.shape, len(student.indexer_layers),
                                                   student.dsa.index_topk), -1, np.int32))
        return batch, trajectories, {}

    def extra_inputs(self, batch, rollouts) -> dict[str, Any]:
        index = teacher_indices([r.metadata["domain"] for r in rollouts], self.plan.routes)
        extra = {"teacher_index": index, **self.teachers.score(batch, index)}
        if self.config.balance.enabled:
            extra["row_weights"] = self.balance_weights()[index]
        if self.config.teacher_samples.fraction > 0:  # every step has the field: one compiled step serves both kinds
            extra["off_policy"] = np.full(len(index), float(self.pool_step), np.float32)
        return extra

    def balance_weights(self) -> np.ndarray:
        """Each teacher's weight this step, from the running divergences so far."""
        return np.asarray(balance_weights(self.running, self.config.balance.floor), np.float32)

    def step_input(self, scored, extra: dict[str, Any]) -> DistillBatch:
        return DistillBatch(rollout=scored, **extra)

    def dump_fields(self, scored, extra: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in extra.items() if getattr(v, "ndim", 0) == 2}  # the teachers' per-token scores

    def name_metrics(self, metrics: dict[str, Any], extra: dict[str, Any]) -> dict[str, float]:
        """Each teacher's sampled reverse KL under its name (for the teachers with rows in this
        batch: the others have no tokens to average over); the running divergences updated."""
        # the sampled reverse KL exists only on the student's own samples: a pool step has none
        present = set() if self.pool_step else set(np.asarray(extra["teacher_index"]).tolist())
        names = self.plan.teacher_names
        observed = np.asarray(metrics.pop(PER_TEACHER_KL), np.float32)
        metrics = {**super().name_metrics(metrics, extra),
                   **{f"opd/reverse_kl/{names[k]}": float(observed[k]) for k in sorted(present)}}
        if self.config.teacher_samples.fraction > 0:
            metrics["opd/pool_step"] = float(self.pool_step)
        if self.config.balance.enabled:
            # the weights this step trained with (extra_inputs's), then this step's divergences folded in
            metrics.update({f"opd/balance_weight/{name}": float(w) for name, w in zip(names, self.balance_weights())})
            self.running = np.asarray(running_divergence(self.running, observed, np.isin(np.arange(len(names)), list(present)),
                                                         self.config.balance.decay), np.float32)
        return metrics

    def resume_state(self) -> dict[str, Any]:
        """What a checkpoint holds besides the state: the running divergences (NaN: not seen yet)."""
        return {"running_divergence": [None if np.isnan(v) else float(v) for v in self.running]}

    def restore(self, saved: dict[str, Any]) -> None:
        if "running_divergence" in saved:
            self.running = np.array([np.nan if v is None else v for v in saved["running_divergence"]], np.float32)

    def finish(self, state: PolicyState, run_dir: Path, phases: dict[str, float]) -> None:
        began = time.perf_counter()
        export_model(state.model(), run_dir / "student", self.tokenizer, base_model=self.plan.student.path)
        phases["export"] = time.perf_counter() - began
        write_report(self.config, self.plan, state.model(), self.tokenizer, phases, run_dir,
                     teachers_bytes=getattr(self.teachers, "nbytes", None))

    def close(self) -> None:
        if self.teachers is not None:
            self.teachers.close()


def merge(config: MergeConfig, *, resume: bool = False, force: bool = False, stop_after: int | None = None) -> Path:
    """Run (or, with resume, continue) the configured merge; returns the run directory, which
    holds report.json when the merge ends. Every input is checked before the first step.
    stop_after: end after that step as if killed (checkpoints as configured), for tests."""
    run_dir, _ = run(config, OPDTask(config), resume=resume, force=force, stop_after=stop_after)
    return run_dir
