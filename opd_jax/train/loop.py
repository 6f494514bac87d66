"""`opd-jax train`: PPO as a task of the one run loop (`opd_jax.train.runner`). Per step: prompts
from the grain stream, G samples each through the rollout engine, verifier rewards, θ_old
log-probs and values recomputed on the trainer, the PPO step (IcePop by default), the new weights
pushed to the engine; held-out accuracy every `eval_every` steps; checkpoints every
`checkpoint.every` steps and at the end."""

from __future__ import annotations

import functools
import json
import resource
import time
from pathlib import Path
from typing import Any

import jax

from opd_jax.config import TrainConfig, scoring_temperature
from opd_jax.core import PPOState, make_optimizer, ppo_step, score_batch
from opd_jax.core.update import trainable
from opd_jax.models import export_model
from opd_jax.run_files import checkpoint_steps
from opd_jax.train.build import add_configured_adapters, build_critic, build_model
from opd_jax.train.preflight import check_estimator, check_index_replay, check_indexer_training, check_run_inputs
from opd_jax.train.runner import Task, run
from opd_jax.train.sft import warm_start

__all__ = ["PPOTask", "memory_report", "train"]


def memory_report(state: PPOState) -> dict[str, float | bool]:
    """Bytes of policy, critic, KL reference and both optimizer states (what training holds
    besides activations; 0 for a critic or reference the run does not have), of the parameters
    that train (with LoRA: the adapters and the value head; else policy and critic), whether it
    has a critic, and this process's peak resident memory so far."""
    nbytes = lambda tree: float(sum(x.nbytes for x in jax.tree.leaves(tree)))  # noqa: E731
    return {"policy_gib": nbytes(state.policy) / 2**30, "critic": state.has_critic,
            "trained_gib": nbytes((trainable(state.policy), trainable(state.critic))) / 2**30,
            "critic_gib": nbytes(state.critic) / 2**30, "reference_gib": nbytes(state.reference) / 2**30,
            "optimizer_states_gib": nbytes((state.policy_opt, state.critic_opt)) / 2**30,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


class PPOTask(Task):
    """PPO with a learned critic (or the GRPO baseline): the policy from the model section (and
    the supervised warm start on a new run), the critic on its backbone, `ppo_step`."""

    command = "train"
    nonfinite_inputs = "log-probs or values"

    def __init__(self, config: TrainConfig):
        self.config = config
        self.data = config.data
        temperature = scoring_temperature(config.rollout)
        self.replays_routing = config.algorithm.ppo.routing_replay == "r3"
        self.replays_indices = config.algorithm.ppo.index_replay
        self.update = config.algorithm.ppo.update
        self.scoring_fn = functools.partial(score_batch, temperature=temperature, routing_replay=self.replays_routing,
                                            index_replay=self.replays_indices,
                                            old_logprobs=config.algorithm.ppo.old_logprobs)
        self.step_fn = functools.partial(ppo_step, config=config.algorithm.ppo,
                                         group_size=config.rollout.samples_per_prompt, temperature=temperature,
                                         with_targets=config.logging.dump_rollouts)

    def check_inputs(self) -> None:
        model = check_run_inputs(mesh=self.config.mesh, models={"model": self.config.model}, data=self.config.data,
                                 max_new_tokens=self.config.rollout.max_new_tokens, rollout=self.config.rollout)
        check_estimator("algorithm.ppo", self.config.algorithm.ppo, self.config.rollout.samples_per_prompt)
        check_index_replay("algorithm.ppo.index_replay", self.replays_indices, self.config.rollout, model)
        check_indexer_training(self.config.sft, model, self.config.model.lora is not None)

    def setup(self, run_dir: Path, mesh: jax.sharding.Mesh, resuming: bool) -> dict[str, float]:
        """The policy; on a run without RL checkpoints yet, warm-started first (RUN_DIR/warm_start/,
        a run of its own: a stop in it keeps its checkpoint and `--resume` continues it); with
        `model.lora`, adapters added first, so the warm start trains them too."""
        self.policy, self.tokenizer = build_model(self.config.model)
        # a GGUF policy's architecture is known only now
        check_index_replay("algorithm.ppo.index_replay", self.replays_indices, self.config.rollout, self.policy.config)
        self.policy = add_configured_adapters(self.policy, self.config.model, self.config.seed)  # then all phases train them
        if (resuming and checkpoint_steps(run_dir)) or not self.config.sft.steps:
            return {}
        began = time.perf_counter()
        self.policy = warm_start(self.policy, self.tokenizer, self.config, run_dir)
        return {"warm start": time.perf_counter() - began}

    def create_state(self) -> PPOState:
        """The policy; only when the estimator needs one, the critic with its optimizer; only when a
        KL term is on, the frozen reference (the policy as RL starts: after the warm start)."""
        algorithm = self.config.algorithm
        optimizer = functools.partial(make_optimizer, compute_dtype=self.trainer_dtype)  # float16: loss-scaled
        reference = algorithm.ppo.kl.enabled
        if not algorithm.ppo.uses_critic:
            return PPOState.create(self.policy, None, optimizer(algorithm.policy_optimizer), None, reference=reference)
        return PPOState.create(self.policy, build_critic(self.policy, self.config),
                               optimizer(algorithm.policy_optimizer), optimizer(algorithm.critic_optimizer),
                               reference=reference)

    def policy_params(self, state: PPOState):
        return state.policy

    def name_metrics(self, metrics: dict[str, Any], extra: dict[str, Any]) -> dict[str, float]:
        metrics = super().name_metrics(metrics, extra)
        if metrics.get("policy/trained", 1.0):
            return metrics
        # During the critic's warm-up the policy's update is skipped and its metrics are the zeros
        # the step fills in: they are not measurements, and would read as a collapsed entropy.
        return {k: v for k, v in metrics.items() if not k.startswith("policy/") or k == "policy/trained"}

    def finish(self, state: PPOState, run_dir: Path, phases: dict[str, float]) -> None:
        with (run_dir / "memory.json").open("w") as f:
            json.dump(memory_report(state), f)
        if self.config.checkpoint.export_hf:
            export_model(state.policy_model(), run_dir / "hf_policy", self.tokenizer,
                         base_model=self.config.model.path)


def train(config: TrainConfig, *, resume: bool = False, force: bool = False, stop_after: int | None = None) -> Path:
    """Run (or, with resume, continue) the configured training; returns the run directory.
    force: resume even when the config changes what a resume cannot honour (`resume_fixed`).
    stop_after: end after that step as if killed (checkpoints as configured), for tests."""
    run_dir, _ = run(config, PPOTask(config), resume=resume, force=force, stop_after=stop_after)
    return run_dir
