"""`opd-jax train`: the RL loop. Per step: prompts from the grain stream, G samples each through
the rollout engine, verifier rewards, θ_old log-probs and values recomputed on the trainer, the
PPO step (IcePop by default), the new weights pushed to the engine; held-out accuracy every
`eval_every` steps; checkpoints every `checkpoint.every` steps and at the end."""

from __future__ import annotations

import dataclasses
import functools
import json
import resource
import time
from pathlib import Path

import jax
import numpy as np

from opd_jax.config import TrainConfig, save_config
from opd_jax.core import PPOState, make_optimizer, ppo_step, score_batch, validate_batch
from opd_jax.data import eval_prompts, take, train_prompts
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
from opd_jax.rewards import load_reward_fn
from opd_jax.train.batching import RewardError, rollouts_to_batch, score_rollouts
from opd_jax.train.build import build_critic, build_policy, encode_prompt, stop_ids
from opd_jax.train.checkpoint import Checkpoints
from opd_jax.train.engines import close_engine, engine_metrics, make_engine, weight_update
from opd_jax.train.evaluate import evaluate
from opd_jax.train.metrics import MetricsLog, plot_curves
from opd_jax.train.sft import warm_start
from rollout_bridge.pipe import PipeError, RolloutPipe
from rollout_bridge.protocol import EngineError
from rollout_bridge.records import Request, SamplingParams


class RunError(RuntimeError):
    """A run that must stop; the message says why."""


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
    checkpoints = Checkpoints(run_dir / "checkpoints", config.checkpoint.keep)
    start = checkpoints.latest_step()
    if start is not None and not resume:
        raise RunError(f"{run_dir} already holds checkpoints (latest: step {start}); pass --resume to continue "
                       f"it or choose another logging.run_dir")
    save_config(config, run_dir / "config.yaml")
    reward_fn = load_reward_fn(config.data.reward_fn) if config.data.reward_fn else None

    policy, tokenizer = build_policy(config)
    if start is None and config.sft.steps:
        policy = warm_start(policy, tokenizer, config, run_dir / "sft_metrics.jsonl")
    critic = build_critic(policy, config)
    group = config.rollout.samples_per_prompt
    # the trainer scores what the engine sampled: softmax(logits / T) (greedy engines report T = 1)
    temperature = config.rollout.temperature or 1.0
    ppo_config = dataclasses.replace(config.algorithm.ppo, group_size=group, temperature=temperature)
    state = PPOState.create(policy, critic, make_optimizer(config.algorithm.policy_optimizer),
                            make_optimizer(config.algorithm.critic_optimizer))
    prompts = iter(train_prompts(config.data, process_index=jax.process_index(), process_count=jax.process_count()))
    if start is not None:
        state, meta = checkpoints.restore(start, state)
        prompts.set_state(meta["data"])
    mesh = make_mesh(config.mesh)
    state = shard(state, tree_shardings(state, mesh))

    rollout = config.rollout
    encode = functools.partial(encode_prompt, tokenizer=tokenizer, chat_template=config.data.chat_template)
    stops = stop_ids(tokenizer, policy)
    held_out = eval_prompts(config.data)
    longest_prompt = max((len(encode(e)) for v in held_out.values() for e in v), default=64)
    sampling = SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                              top_p=rollout.top_p, top_k=rollout.top_k, stop_token_ids=stops)
    try:
        engine = make_engine(config, weight_update(config, policy, state.policy, tokenizer, start or 0),
                             max_cache_len=2 * longest_prompt + rollout.max_new_tokens + 16,
                             pad_id=tokenizer.pad_token_id or 0, refit_dir=run_dir / "refit")
    except EngineError as e:
        raise RunError(f"the rollout engine did not start: {e}") from None
    groups_drawn = [meta["groups_drawn"] if start is not None else 0]

    def next_group() -> list[Request]:
        """G requests of the next prompt; each sample's seed follows from the run seed and its
        position in the stream, so a resumed run draws the same samples."""
        (example,) = take(prompts, 1)
        index = groups_drawn[0]
        groups_drawn[0] += 1
        ids = encode(example)
        # the example rides along in the metadata (engines copy it onto the rollout, never send it)
        return [Request(ids, sampling, {"domain": example.domain, "group": index, "example": example},
                        seed=(config.seed * 1_000_003 + index * group + j) % 2**31) for j in range(group)]

    pipe = RolloutPipe(engine, next_group, max_staleness=rollout.max_staleness, keep_stale=rollout.keep_stale)

    def run_eval(at_step: int) -> dict[str, float]:
        try:
            return evaluate(engine, tokenizer, held_out, encode, max_new_tokens=rollout.max_new_tokens,
                            stop_token_ids=stops, reward_fn=reward_fn)
        except RewardError as e:
            raise RunError(f"evaluation at step {at_step}: {e}") from None

    log = MetricsLog(run_dir, config.steps, start or 0, tensorboard=config.logging.tensorboard,
                     progress_bar=config.logging.progress_bar)
    step_fn = score_fn = None
    try:
        if start is None and config.logging.eval_at_start:
            log.log(0, run_eval(0), advance=False)
        for step in range(start or 0, config.steps):
            began = time.perf_counter()
            try:
                groups = pipe.take(config.data.prompts_per_step, trainer_version=step)
            except PipeError as e:
                raise RunError(f"step {step + 1}: {e}") from None
            rollout_s = time.perf_counter() - began
            rollouts = [r for g in groups for r in g]
            examples = [r.metadata["example"] for r in rollouts]
            try:
                rewards = score_rollouts(rollouts, examples, tokenizer, reward_fn)
            except RewardError as e:
                raise RunError(f"step {step + 1}: {e}") from None
            batch = rollouts_to_batch(rollouts, rewards, pad_id=tokenizer.pad_token_id or 0,
                                      truncated=rollout.truncated, truncation_penalty=rollout.truncation_penalty)
            validate_batch(batch, vocab_size=policy.config.vocab_size)
            if step_fn is None:
                score_fn = sharded_scoring(functools.partial(score_batch, temperature=temperature), state, batch, mesh)
                step_fn = sharded_step(functools.partial(ppo_step, config=ppo_config), state,
                                       jax.eval_shape(score_batch, state, batch), mesh)
            scored = score_fn(state, shard(batch, batch_shardings(batch, mesh)))
            state, metrics = step_fn(state, scored)
            metrics = {k: float(v) for k, v in metrics.items()}
            if metrics["nonfinite_inputs"]:
                raise RunError(f"step {step + 1}: {int(metrics['nonfinite_inputs'])} non-finite log-probs or values")
            refit_began = time.perf_counter()
            try:
                engine.update_weights(weight_update(config, policy, state.policy, tokenizer, step + 1))
            except EngineError as e:
                raise RunError(f"step {step + 1}: weight refit failed: {e}") from None
            generated = sum(len(r.output_ids) for r in rollouts)
            metrics.update({"rollout/tokens_per_s": generated / max(rollout_s, 1e-9), "rollout/wait_s": rollout_s,
                            "rollout/refit_s": time.perf_counter() - refit_began,
                            "rollout/staleness": float(np.mean([step - r.weight_version for r in rollouts])),
                            "rollout/truncated_frac": float(np.mean([r.finish_reason == "length" for r in rollouts])),
                            **pipe.stats.take(), **engine_metrics(engine)})
            done = step + 1
            if done % config.logging.eval_every == 0 or done == config.steps:
                metrics.update(run_eval(done))
            log.log(done, metrics)
            if done % config.checkpoint.every == 0 or done == config.steps:
                checkpoints.save(done, state, {"data": prompts.get_state(), "groups_drawn": groups_drawn[0]})
            if stop_after is not None and done >= stop_after:
                return run_dir
    finally:
        log.close()
        checkpoints.close()
        close_engine(engine)
    with (run_dir / "memory.json").open("w") as f:
        json.dump(memory_report(state), f)
    if config.checkpoint.export_hf and jax.process_index() == 0:
        save_model(state.policy_model(), run_dir / "hf_policy", tokenizer)
    if config.logging.plot and jax.process_index() == 0:
        plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    return run_dir
