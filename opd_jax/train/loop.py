"""`opd-jax train`: the RL loop. Per step: prompts from the grain stream, G samples each through
the rollout engine, verifier rewards, θ_old log-probs and values recomputed on the trainer, the
PPO step (IcePop by default), the new weights pushed to the engine; held-out accuracy every
`eval_every` steps; checkpoints every `checkpoint.every` steps and at the end."""

from __future__ import annotations

import dataclasses
import functools
import json
import resource
from pathlib import Path

import jax

from opd_jax.config import TrainConfig, save_config
from opd_jax.core import PPOState, make_optimizer, ppo_step, score_batch
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
from opd_jax.train.build import build_critic, build_policy
from opd_jax.train.checkpoint import Checkpoints
from opd_jax.train.errors import RunError
from opd_jax.train.metrics import MetricsLog, plot_curves
from opd_jax.train.rollouts import RolloutSession
from opd_jax.train.sft import warm_start

__all__ = ["RunError", "memory_report", "train"]


def memory_report(state: PPOState) -> dict[str, float]:
    """Bytes of policy, critic and both optimizer states (what training holds besides
    activations), and this process's peak resident memory so far."""
    nbytes = lambda tree: float(sum(x.nbytes for x in jax.tree.leaves(tree)))  # noqa: E731
    return {"policy_gib": nbytes(state.policy) / 2**30, "critic_gib": nbytes(state.critic) / 2**30,
            "optimizer_states_gib": nbytes((state.policy_opt, state.critic_opt)) / 2**30,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def train(config: TrainConfig, *, resume: bool = False, stop_after: int | None = None) -> Path:
    """Run (or, with resume, continue) the configured training; returns the run directory.
    stop_after: end after that step as if killed (checkpoints as configured), for tests."""
    run_dir = Path(config.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    initialize_distributed(config.distributed)
    checkpoints, start = Checkpoints.for_run(run_dir, config.checkpoint.keep, resume)
    save_config(config, run_dir / "config.yaml")

    policy, tokenizer = build_policy(config)
    if start is None and config.sft.steps:
        policy = warm_start(policy, tokenizer, config, run_dir / "sft_metrics.jsonl")
    critic = build_critic(policy, config)
    # the trainer scores what the engine sampled: softmax(logits / T) (greedy engines report T = 1)
    temperature = config.rollout.temperature or 1.0
    ppo_config = dataclasses.replace(config.algorithm.ppo, group_size=config.rollout.samples_per_prompt,
                                     temperature=temperature)
    state = PPOState.create(policy, critic, make_optimizer(config.algorithm.policy_optimizer),
                            make_optimizer(config.algorithm.critic_optimizer))
    meta = None
    if start is not None:
        state, meta = checkpoints.restore(start, state)
    mesh = make_mesh(config.mesh)
    state = shard(state, tree_shardings(state, mesh))
    try:
        session = RolloutSession(rollout=config.rollout, data=config.data, seed=config.seed, policy=policy,
                                 params=state.policy, tokenizer=tokenizer, run_dir=run_dir, version=start or 0,
                                 resume=meta)
    except BaseException:
        checkpoints.close()
        raise

    log = MetricsLog(run_dir, config.steps, start or 0, tensorboard=config.logging.tensorboard,
                     progress_bar=config.logging.progress_bar)
    step_fn = score_fn = None
    try:
        if start is None and config.logging.eval_at_start:
            log.log(0, session.evaluate(0), advance=False)
        for step in range(start or 0, config.steps):
            batch, _, metrics = session.next_batch(step, policy.config.vocab_size)
            if step_fn is None:
                score_fn = sharded_scoring(functools.partial(score_batch, temperature=temperature), state, batch, mesh)
                step_fn = sharded_step(functools.partial(ppo_step, config=ppo_config), state,
                                       jax.eval_shape(score_batch, state, batch), mesh)
            scored = score_fn(state, shard(batch, batch_shardings(batch, mesh)))
            state, step_metrics = step_fn(state, scored)
            metrics.update({k: float(v) for k, v in step_metrics.items()})
            if metrics["nonfinite_inputs"]:
                raise RunError(f"step {step + 1}: {int(metrics['nonfinite_inputs'])} non-finite log-probs or values")
            metrics.update(session.refit(state.policy, step + 1))
            done = step + 1
            if done % config.logging.eval_every == 0 or done == config.steps:
                metrics.update(session.evaluate(done))
            log.log(done, metrics)
            if done % config.checkpoint.every == 0 or done == config.steps:
                checkpoints.save(done, state, session.state())
            if stop_after is not None and done >= stop_after:
                return run_dir
    finally:
        log.close()
        checkpoints.close()
        session.close()
    with (run_dir / "memory.json").open("w") as f:
        json.dump(memory_report(state), f)
    if config.checkpoint.export_hf and jax.process_index() == 0:
        save_model(state.policy_model(), run_dir / "hf_policy", tokenizer)
    if config.logging.plot and jax.process_index() == 0:
        plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    return run_dir
