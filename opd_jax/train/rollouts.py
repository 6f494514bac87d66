"""The loop's side of rollout generation, shared by `opd-jax train` and `opd-jax merge`: the engine
(embedded or SGLang, behind rollout_bridge's protocol), prompt groups from the grain stream
through the RolloutPipe (bounded staleness), verifier rewards, the trainer's batch, weight
refits, and held-out evaluation through the same engine."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opd_jax.config import DataSection, RolloutSection, scoring_temperature
from opd_jax.core import RolloutBatch, validate_batch
from opd_jax.data import Example, eval_prompts, take, train_prompts
from opd_jax.models import Decoder, Tokenizer
from opd_jax.rewards import RewardError, load_reward_fn
from opd_jax.train.batching import drop_bad_rewards, rollout_rewards, rollouts_to_batch
from opd_jax.train.build import EngineNumerics, encode_prompt, stop_ids
from opd_jax.train.engines import make_engine, routing_layout, weight_update
from opd_jax.train.errors import RunError
from opd_jax.train.evaluate import evaluate
from rollout_bridge.pipe import PipeError, RolloutPipe
from rollout_bridge.protocol import TEMPERED_UNTRUNCATED, EngineError
from rollout_bridge.records import Request, Rollout, SamplingParams


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
        self.held_out = eval_prompts(data)
        longest_prompt = max((len(self.encode(e)) for v in self.held_out.values() for e in v), default=64)
        self.sampling = SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                                       top_p=rollout.top_p, top_k=rollout.top_k, stop_token_ids=self.stops)
        try:
            self.engine = make_engine(rollout, seed, self._update(params, version),
                                      max_cache_len=2 * longest_prompt + rollout.max_new_tokens + 16,
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
        self.pipe = RolloutPipe(self.engine, self._next_group, max_staleness=rollout.max_staleness,
                                keep_stale=rollout.keep_stale)

    def mismatch_sources(self, trainer_dtype: str, *, replays_routing: bool) -> dict[str, Any]:
        """What the engine is and how it computes unlike the trainer: {"engine", "logprobs",
        "differs_in": {precision, weights, kv_cache, routing: what the engine does}}; routing is
        listed for a MoE policy whose engine routes on its own (no replay)."""
        differs = EngineNumerics.of(self.rollout).differences(trainer_dtype)
        if self.rollout.inject_weight_noise:
            differs["weight_noise"] = f"{self.rollout.inject_weight_noise:g} std"
        if self.rollout.engine == "sglang":
            differs["implementation"] = "sglang"
        if self.policy_config.moe is not None and not replays_routing:
            differs["routing"] = "the engine's own"
        return {"engine": self.rollout.engine, "logprobs": self.engine.logprob_convention, "differs_in": differs}

    def _update(self, params: nnx.State, version: int):
        return weight_update(self.rollout, self.policy_config, params, self.tokenizer, version)

    def _next_group(self) -> list[Request]:
        """G requests of the next prompt; each sample's seed follows from the run seed and its
        position in the stream, so a resumed run draws the same samples."""
        (example,) = take(self.prompts, 1)
        index = self.groups_drawn
        self.groups_drawn += 1
        group = self.rollout.samples_per_prompt
        # the example rides along in the metadata (engines copy it onto the rollout, never send it)
        return [Request(self.encode(example), self.sampling, {"domain": example.domain, "group": index,
                                                              "example": example},
                        seed=(self.seed * 1_000_003 + index * group + j) % 2**31) for j in range(group)]

    def state(self) -> dict[str, Any]:
        """What a checkpoint must hold to resume the prompt stream exactly."""
        return {"data": self.prompts.get_state(), "groups_drawn": self.groups_drawn}

    def next_batch(self, step: int, vocab_size: int) -> tuple[RolloutBatch, list[Rollout], dict[str, float]]:
        """The rollouts for training step `step` (0-based) on weights `step`, their rewards, and
        the trainer's batch of them (checked: named errors for NaN, bad ids, ...)."""
        began = time.perf_counter()
        try:
            groups = self.pipe.take(self.data.prompts_per_step, trainer_version=step)
        except PipeError as e:
            raise RunError(f"step {step + 1}: {e}") from None
        wait = time.perf_counter() - began
        rollouts = [r for g in groups for r in g]
        try:
            rewards = rollout_rewards(rollouts, [r.metadata["example"] for r in rollouts], self.tokenizer,
                                      self.reward_fn, on_bad=self.data.on_bad_reward)
        except RewardError as e:
            raise RunError(f"step {step + 1}: {e} (data.on_bad_reward: skip drops such samples)") from None
        bad = np.isnan(rewards)
        batch = rollouts_to_batch(rollouts, np.nan_to_num(rewards), pad_id=self.tokenizer.pad_token_id or 0,
                                  truncated=self.rollout.truncated, truncation_penalty=self.rollout.truncation_penalty)
        if bad.any():
            kept, mask = drop_bad_rewards(np.where(bad, np.nan, np.asarray(batch.rewards)),
                                          np.asarray(batch.response_mask), self.rollout.samples_per_prompt)
            batch = batch.replace(rewards=jnp.asarray(kept), response_mask=jnp.asarray(mask))
        validate_batch(batch, vocab_size=vocab_size)
        generated = sum(len(r.output_ids) for r in rollouts)
        return batch, rollouts, {
            "rollout/tokens_per_s": generated / max(wait, 1e-9), "rollout/wait_s": wait,
            "rollout/staleness": float(np.mean([step - r.weight_version for r in rollouts])),
            "rollout/truncated_frac": float(np.mean([r.finish_reason == "length" for r in rollouts])),
            **({"reward/bad_samples": float(bad.sum())} if self.data.on_bad_reward == "skip" else {})}

    def refit(self, params: nnx.State, version: int) -> dict[str, float]:
        """Serve weights `version` from now on; the refit time and the engine's counters."""
        began = time.perf_counter()
        try:
            self.engine.update_weights(self._update(params, version))
        except EngineError as e:
            raise RunError(f"step {version}: weight refit failed: {e}") from None
        return {"rollout/refit_s": time.perf_counter() - began, **self.pipe.stats.take(),
                **{f"rollout/{k}": v for k, v in self.engine.metrics().items()}}

    def evaluate(self, at_step: int) -> dict[str, float]:
        """Held-out accuracy per domain of the weights the engine serves now (greedy)."""
        try:
            return evaluate(self.engine, self.tokenizer, self.held_out, self.encode,
                            max_new_tokens=self.rollout.max_new_tokens, stop_token_ids=self.stops,
                            reward_fn=self.reward_fn, on_bad=self.data.on_bad_reward)
        except RewardError as e:
            raise RunError(f"evaluation at step {at_step}: {e}") from None

    def close(self) -> None:
        self.engine.close()
