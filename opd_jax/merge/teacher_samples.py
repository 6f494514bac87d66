"""The teachers' own samples (`merge.teacher_samples`): a pool drawn once before the merge trains,
each teacher answering prompts of its own domains, for GKD's mixture (a share of the steps
trains on the pool instead of the student's samples) and MOPD's supervised warm-up.

The pool is a pure function of the config and the teachers (its prompts come from a draw of
their own, each sample seeded by the run seed and its position), so a resumed merge draws it
again identically instead of storing it; RUN_DIR/teacher_samples.jsonl shows it to the user.
Which steps are the pool's, and which pool rows a step takes, follow from (seed, step) alone.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from opd_jax.config.opd_pipeline import MergeConfig
from opd_jax.core import RolloutBatch
from opd_jax.data import validation_prompts
from opd_jax.envs import Trajectory
from opd_jax.merge.plan import MergePlan
from opd_jax.merge.teachers import TeacherError, load_teacher
from opd_jax.models import Decoder, Tokenizer
from opd_jax.train import held_out_evaluator, rollout_rewards, stop_if_requested, trajectories_to_batch
from rollout_bridge.records import Failure, SamplingParams

_MIX_STREAM, _ROWS_STREAM, _WARMUP_STREAM = 1, 2, 3  # independent random streams of the pool's draws


@dataclasses.dataclass(frozen=True)
class TeacherPool:
    """The kept samples as trajectories (metadata: domain, example), each one's teacher index, and
    per domain how many were drawn and kept."""

    trajectories: tuple[Trajectory, ...]
    teacher_index: np.ndarray
    drawn: dict[str, int]
    kept: dict[str, int]

    def batch(self, rows: np.ndarray, pad_id: int) -> tuple[RolloutBatch, list[Trajectory], np.ndarray]:
        """The pool rows `rows` as a trainer batch (the teachers' log-probs as logp_infer), their
        trajectories and teacher indices."""
        picked = [self.trajectories[i] for i in rows]
        return trajectories_to_batch(picked, pad_id=pad_id), picked, self.teacher_index[rows]


def draw_pool(config: MergeConfig, plan: MergePlan, tokenizer: Tokenizer, student: Decoder) -> TeacherPool:
    """Each teacher samples one answer to `teacher_samples.per_domain` prompts of each of its
    domains (the rollout's temperature, top-p/k and length), through the embedded engine at the
    rollout's precision; kept where the verifier rewards it (> 0) when correct_only. A teacher
    that keeps nothing of a domain is a TeacherError naming both."""
    section = config.teacher_samples
    prompts = validation_prompts(plan.data, section.per_domain, draw="teacher_samples")
    rollout = config.rollout
    sampling = SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                              top_p=rollout.top_p, top_k=rollout.top_k)
    sampler = held_out_evaluator(tokenizer, student, rollout, plan.data, held_out=prompts)
    trajectories, index, drawn, kept = [], [], {}, {}
    try:
        for k, spec in enumerate(plan.teachers):
            model, _ = load_teacher(spec.name, spec.path, config.teachers.dtype)
            for j, domain in enumerate(d for d in spec.domains if d in prompts):
                stop_if_requested(f"the teachers' samples ({spec.name}, {domain})")
                examples = prompts[domain]
                seed = int(np.random.SeedSequence([config.seed, k, j]).generate_state(1)[0] % 2**30)
                completions = sampler.sample(model, domain, sampling, seed)
                failed = [c for c in completions if isinstance(c, Failure)]
                if failed:
                    raise TeacherError(f"teacher {spec.name!r} could not sample {domain} prompts: {failed[0].error}")
                rewards = rollout_rewards(completions, examples, tokenizer, sampler.reward_fn, on_bad="skip")
                good = rewards > 0 if section.correct_only else ~np.isnan(rewards)
                drawn[domain], kept[domain] = len(examples), int(good.sum())
                if not good.any():
                    raise TeacherError(f"teacher {spec.name!r} answered none of {len(examples)} {domain} prompts "
                                       f"correctly, so the pool has nothing of {domain} (check the expert, or set "
                                       f"teacher_samples.correct_only false)")
                for c, r in zip(np.asarray(completions, dtype=object)[good], rewards[good]):
                    trajectories.append(Trajectory.single_turn(c, float(r)))
                    index.append(k)
    finally:
        sampler.close()
    return TeacherPool(tuple(trajectories), np.asarray(index, np.int32), drawn, kept)


def write_pool(pool: TeacherPool, names: list[str], tokenizer: Tokenizer, path: Path) -> None:
    """The pool as JSONL (teacher, domain, prompt, response, reward), for reading."""
    with path.open("w") as f:
        for t, k in zip(pool.trajectories, pool.teacher_index):
            f.write(json.dumps({"teacher": names[k], "domain": t.metadata["domain"],
                                "prompt": tokenizer.decode(list(t.prompt_ids)),
                                "response": tokenizer.decode(list(t.response_ids)), "reward": t.reward}) + "\n")


def pool_step(fraction: float, seed: int, step: int) -> bool:
    """GKD's per-step coin (Agarwal et al. 2024, Alg. 1): does step `step` (0-based) train on the
    teachers' pool rather than on the student's own samples? True with probability `fraction`."""
    if fraction <= 0:
        return False
    return bool(np.random.default_rng([seed, _MIX_STREAM, step]).random() < fraction)


def pool_rows(size: int, rows: int, seed: int, step: int, *, warmup: bool = False) -> np.ndarray:
    """Which `rows` pool entries a step takes: uniform without replacement (with it when the pool
    is smaller), from a stream of (seed, step) of its own for the warm-up and the OPD steps."""
    rng = np.random.default_rng([seed, _WARMUP_STREAM if warmup else _ROWS_STREAM, step])
    return rng.choice(size, rows, replace=size < rows)
