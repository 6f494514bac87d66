"""The loop's side of rollout generation, shared by `opd-jax train` and `opd-jax merge`: the engine
(embedded or SGLang, behind rollout_bridge's protocol), prompt groups from the grain stream
through the RolloutPipe (bounded staleness), verifier rewards, the trainer's batch, weight
refits, and held-out evaluation through the same engine."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opd_jax.config import DataSection, RolloutSection, scoring_temperature
from opd_jax.core import RolloutBatch, validate_batch
from opd_jax.core.algorithms.dynamic_sampling import informative_groups
from opd_jax.core.algorithms.overlong import overlong_penalty
from opd_jax.data import Example, eval_prompts, take, train_prompts
from opd_jax.envs import Trajectory
from opd_jax.models import Decoder, Tokenizer
from opd_jax.rewards import RewardError, load_reward_fn
from opd_jax.train.batching import drop_bad_rewards, rollout_rewards, trajectories_to_batch, truncation_treatment, without_rows
from opd_jax.train.build import EngineNumerics, encode_prompt, stop_ids
from opd_jax.train.engines import make_engine, routing_layout, weight_update
from opd_jax.train.episodes import EpisodePlayer, episode_metrics
from opd_jax.train.errors import RunError
from opd_jax.train.evaluate import evaluate
from rollout_bridge.pipe import PipeError, RolloutPipe
from rollout_bridge.protocol import TEMPERED_UNTRUNCATED, EngineError
from rollout_bridge.records import Request, SamplingParams


@dataclasses.dataclass
class _Group:
    """One prompt's samples (or one instance's episodes), rewarded."""

    trajectories: list[Trajectory]
    rewards: list[float]
    keep: list[bool]
    generated: int  # the policy's sampled tokens

    def informative(self, group_size: int) -> bool:
        return bool(informative_groups(jnp.asarray(self.rewards, jnp.float32), group_size)[0])


class RolloutSession:
    """Rollouts of `policy` (its parameters `params`, weight version `version`) on the prompts of
    `data`, `rollout.samples_per_prompt` per prompt. `resume`: the `state()` of a checkpoint, so
    a resumed run draws the same prompts and samples as an uninterrupted one."""

    def __init__(self, *, rollout: RolloutSection, data: DataSection, seed: int, policy: Decoder, params: nnx.State,
                 tokenizer: Tokenizer, run_dir: Path, version: int = 0, resume: dict[str, Any] | None = None,
                 record_routing: bool = False):
        self.rollout, self.data, self.seed = rollout, data, seed
        self.policy_config, self.tokenizer = policy.config, tokenizer
        self.reward_fn = load_reward_fn(data.reward_fn) if data.reward_fn else None
        self.prompts = iter(train_prompts(data, process_index=jax.process_index(), process_count=jax.process_count()))
        self.groups_drawn = 0
        if resume is not None:
            self.prompts.set_state(resume["data"])
            self.groups_drawn = resume["groups_drawn"]
        self.encode: Callable[[Example], list[int]] = functools.partial(
            encode_prompt, tokenizer=tokenizer, chat_template=data.chat_template)
        self.stops = stop_ids(tokenizer, policy)
        held_out = eval_prompts(data)
        self.held_out = {d: v for d, v in held_out.items() if v[0].episode is None}
        self.held_out_episodes = {d: v for d, v in held_out.items() if v[0].episode is not None}
        longest_prompt = max((len(self.encode(e)) for v in self.held_out.values() for e in v), default=64)
        has_episodes = data.has_environments
        self.sampling = SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                                       top_p=rollout.top_p, top_k=rollout.top_k, stop_token_ids=self.stops)
        try:
            cache = 2 * longest_prompt + rollout.max_new_tokens + 16
            self.engine = make_engine(rollout, seed, self._update(params, version),
                                      max_cache_len=max(cache, rollout.episodes.max_tokens + 16) if has_episodes
                                      else cache,
                                      pad_id=tokenizer.pad_token_id or 0, refit_dir=run_dir / "refit",
                                      routing=routing_layout(policy.config) if record_routing else None)
        except EngineError as e:
            raise RunError(f"the rollout engine did not start: {e}") from None
        temperature = scoring_temperature(rollout)
        if self.engine.logprob_convention != TEMPERED_UNTRUNCATED and temperature != 1.0:
            self.engine.close()
            raise RunError(f"the rollout engine reports log-probs {self.engine.logprob_convention} "
                           f"(SGLANG_RETURN_ORIGINAL_LOGPROB is set for its servers), but the trainer scores "
                           f"log_softmax(logits / {temperature}): unset it, or sample at rollout.temperature 1")
        self.episodes = EpisodePlayer(self.engine, tokenizer, chat_template=data.chat_template,
                                      episodes=rollout.episodes, turn_tokens=rollout.max_new_tokens,
                                      end_of_turn=self.stops[0]) \
            if has_episodes else None
        self.pipe = RolloutPipe(self.engine, self._next_group, max_staleness=rollout.max_staleness,
                                keep_stale=rollout.keep_stale)

    def mismatch_sources(self, trainer_dtype: str, *, replays_routing: bool, replays_indices: bool = False
                         ) -> dict[str, Any]:
        """What the engine is and how it computes unlike the trainer: {"engine", "logprobs",
        "differs_in": {precision, weights, kv_cache, routing, indices: what the engine does}};
        routing is listed for a MoE policy whose engine routes on its own (no replay), indices for
        a DSA policy whose trainer picks its own keys (no index replay)."""
        differs = EngineNumerics.of(self.rollout).differences(trainer_dtype)
        if self.rollout.inject_weight_noise:
            differs["weight_noise"] = f"{self.rollout.inject_weight_noise:g} std"
        if self.rollout.engine == "sglang":
            differs["implementation"] = "sglang"
        if self.policy_config.moe is not None and not replays_routing:
            differs["routing"] = "the engine's own"
        if self.policy_config.dsa is not None and not replays_indices:
            differs["indices"] = "the engine's own keys"
        return {"engine": self.rollout.engine, "logprobs": self.engine.logprob_convention, "differs_in": differs}

    def _update(self, params: nnx.State, version: int):
        return weight_update(self.rollout, self.policy_config, params, self.tokenizer, version, seed=self.seed)

    def _next_group(self) -> list[Request] | Awaitable[list[Trajectory]]:
        """G requests of the next prompt, or G episodes of the next environment instance; each
        sample's seed follows from the run seed and its position in the stream, so a resumed run
        draws the same samples."""
        (example,) = take(self.prompts, 1)
        index = self.groups_drawn
        self.groups_drawn += 1
        group = self.rollout.samples_per_prompt
        seeds = [(self.seed * 1_000_003 + index * group + j) % 2**31 for j in range(group)]
        # the example rides along in the metadata (engines copy it onto the rollout, never send it)
        metadata = {"domain": example.domain, "group": index, "example": example}
        if example.episode is not None:
            return self.episodes.group(example, self.sampling, seeds, metadata)
        return [Request(self.encode(example), self.sampling, metadata, seed=s) for s in seeds]

    def state(self) -> dict[str, Any]:
        """What a checkpoint must hold to resume the prompt stream exactly."""
        return {"data": self.prompts.get_state(), "groups_drawn": self.groups_drawn}

    def next_batch(self, step: int, vocab_size: int) -> tuple[RolloutBatch, list[Trajectory], dict[str, float]]:
        """The rollouts and episodes for training step `step` (0-based) on weights `step`, as
        trajectories, their rewards, and the trainer's batch of them (checked: named errors for
        NaN, bad ids, ...). Failed episodes and bad rewards leave the loss and are counted."""
        began = time.perf_counter()
        groups, sampling = self._groups(step)
        generated = sampling.pop("generated")
        wait = time.perf_counter() - began
        trajectories = [t for g in groups for t in g.trajectories]
        rewards = np.asarray([x for g in groups for x in g.rewards], np.float32)
        keep = np.asarray([k for g in groups for k in g.keep])
        bad = np.isnan(rewards)  # bad rewards (skipped) and failed episodes
        batch = without_rows(trajectories_to_batch(trajectories, pad_id=self.tokenizer.pad_token_id or 0,
                                                   rewards=np.nan_to_num(rewards)), keep)
        if bad.any():
            kept, mask = drop_bad_rewards(rewards, np.asarray(batch.response_mask), self.rollout.samples_per_prompt)
            batch = batch.replace(rewards=jnp.asarray(kept), response_mask=jnp.asarray(mask))
        validate_batch(batch, vocab_size=vocab_size)
        is_episode = [t.metadata["example"].episode is not None for t in trajectories]
        episodes = [t for t, e in zip(trajectories, is_episode) if e]
        single = [t for t, e in zip(trajectories, is_episode) if not e]
        bad_rewards = int(bad.sum()) - sum(t.end == "failed" for t in episodes)
        return batch, trajectories, {
            # the policy's sampled tokens (dropped groups' too): a run's compute, summed over steps
            "rollout/tokens": float(generated),
            "rollout/tokens_per_s": generated / max(wait, 1e-9), "rollout/wait_s": wait,
            "rollout/staleness": float(np.mean([step - t.weight_version for t in trajectories])),
            **({"rollout/truncated_frac": float(np.mean([t.finish_reasons[-1:] == ("length",) for t in single]))}
               if single else {}),
            **(episode_metrics(episodes) if episodes else {}),
            **({"reward/bad_samples": float(bad_rewards)} if self.data.on_bad_reward == "skip" else {}),
            **sampling}

    def _groups(self, step: int) -> tuple[list[_Group], dict[str, float]]:
        """The step's prompt groups, rewarded. With rollout.dynamic_sampling, groups whose rewards
        are all equal are dropped and more drawn, up to dynamic_sampling_rounds draws; a batch
        still short then takes back the first dropped ones, so its size holds (counted)."""
        wanted = self.data.prompts_per_step
        drawn = [self._rewarded(g, step) for g in self._take(wanted, step)]
        generated = sum(g.generated for g in drawn)
        if not self.rollout.dynamic_sampling:
            return drawn, {"generated": generated}
        kept, dropped, rounds = [], [], 1
        while True:
            for group in drawn:
                (kept if group.informative(self.rollout.samples_per_prompt) else dropped).append(group)
            if len(kept) >= wanted or rounds >= self.rollout.dynamic_sampling_rounds:
                break
            drawn = [self._rewarded(g, step) for g in self._take(wanted - len(kept), step)]
            generated += sum(g.generated for g in drawn)
            rounds += 1
        refilled = dropped[:max(wanted - len(kept), 0)]
        return kept[:wanted] + refilled, {
            "generated": generated, "rollout/dynamic_draw_rounds": float(rounds),
            "rollout/dynamic_dropped_groups": float(len(dropped) - len(refilled)),
            "rollout/dynamic_uninformative_groups": float(len(refilled))}

    def _take(self, groups: int, step: int) -> list[list[Any]]:
        try:
            return self.pipe.take(groups, trainer_version=step)
        except PipeError as e:
            raise RunError(f"step {step + 1}: {e}") from None

    def _rewarded(self, group: list[Any], step: int) -> _Group:
        """A group's trajectories, rewards (NaN: a failed episode or a skipped bad reward) and which
        rows stay in the batch."""
        if isinstance(group[0], Trajectory):  # episodes: the environment gave the rewards
            rewards = [math.nan if t.end == "failed" else t.reward for t in group]
            return _Group(list(group), rewards, [True] * len(group), sum(sum(t.model_mask) for t in group))
        try:
            rewards = rollout_rewards(group, [r.metadata["example"] for r in group], self.tokenizer,
                                      self.reward_fn, on_bad=self.data.on_bad_reward)
        except RewardError as e:
            raise RunError(f"step {step + 1}: {e} (data.on_bad_reward: skip drops such samples)") from None
        if self.rollout.overlong_buffer:
            lengths = np.asarray([len(r.output_ids) for r in group])
            rewards = rewards + np.asarray(overlong_penalty(jnp.asarray(lengths), self.rollout.max_new_tokens,
                                                            self.rollout.overlong_buffer, self.rollout.overlong_penalty))
        rewards, keep = truncation_treatment(group, rewards, self.rollout.truncated, self.rollout.truncation_penalty)
        # a bad sample's NaN stays in `rewards` (it leaves the loss), not in its token rewards
        trajectories = [Trajectory.single_turn(r, 0.0 if math.isnan(x) else x) for r, x in zip(group, rewards)]
        return _Group(trajectories, list(rewards), list(keep), sum(sum(t.model_mask) for t in trajectories))

    def refit(self, params: nnx.State, version: int) -> dict[str, float]:
        """Serve weights `version` from now on; the refit time and the engine's counters."""
        began = time.perf_counter()
        try:
            self.engine.update_weights(self._update(params, version))
        except EngineError as e:
            raise RunError(f"step {version}: weight refit failed: {e}") from None
        return {"rollout/refit_s": time.perf_counter() - began, **self.pipe.stats.take(),
                **{f"rollout/{k}": v for k, v in self.engine.metrics().items()}}

    def evaluate(self, at_step: int, stop: Callable[[], bool] = lambda: False) -> dict[str, float]:
        """Held-out accuracy per domain of the weights the engine serves now (greedy); `stop()`,
        asked between domains, ends it early with EvaluationStopped."""
        try:
            out = evaluate(self.engine, self.tokenizer, self.held_out, self.encode,
                           max_new_tokens=self.rollout.max_new_tokens, stop_token_ids=self.stops,
                           reward_fn=self.reward_fn, on_bad=self.data.on_bad_reward, stop=stop)
        except RewardError as e:
            raise RunError(f"evaluation at step {at_step}: {e} (data.on_bad_reward: skip drops such samples)") from None
        if self.episodes is not None:
            out.update(self.episodes.evaluate(self.held_out_episodes, self.stops, stop=stop))
            accuracies = [v for k, v in out.items() if k.endswith("/accuracy") and k != "eval/accuracy"]
            out["eval/accuracy"] = float(np.nanmean(accuracies))
        return out

    def close(self) -> None:
        self.engine.close()
