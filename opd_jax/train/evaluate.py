"""Held-out accuracy per domain: greedy decoding through the engine, scored by the verifiers."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from flax import nnx

from opd_jax.config import DataSection, RolloutSection
from opd_jax.data import Example, eval_prompts
from opd_jax.models import Decoder, Tokenizer
from opd_jax.rewards import RewardFn, load_reward_fn
from opd_jax.sampling import EmbeddedEngine, Sampler
from opd_jax.train.batching import rollout_rewards
from opd_jax.train.build import EngineNumerics, encode_prompt, engine_model, stop_ids
from opd_jax.train.errors import EvaluationStopped, RunError
from rollout_bridge.pipe import EngineThread
from rollout_bridge.protocol import WeightUpdate
from rollout_bridge.records import Failure, Request, Rollout, SamplingParams


def evaluate(engine: EngineThread, tokenizer: Tokenizer, held_out: dict[str, Sequence[Example]],
             encode: Callable[[Example], list[int]], *, max_new_tokens: int, stop_token_ids: tuple[int, ...],
             reward_fn: RewardFn | None = None, on_bad: str = "fail",
             stop: Callable[[], bool] = lambda: False) -> dict[str, float]:
    """{"eval/<domain>/accuracy": mean reward of greedy answers, ..., "eval/accuracy": the mean
    over domains}; nothing without held-out prompts. A request the engine could not serve stops
    the evaluation with its error; bad samples (on_bad="skip") leave the mean and are counted in
    "eval/<domain>/bad_samples". `stop()` is asked before each domain: True raises
    EvaluationStopped (a run asked to stop does not wait for the rest)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stop_token_ids)
    out: dict[str, float] = {}
    for domain, examples in sorted(held_out.items()):
        if stop():
            raise EvaluationStopped
        completions = engine.generate([Request(encode(e), params, {"domain": domain}) for e in examples])
        failed = [c for c in completions if isinstance(c, Failure)]
        if failed:
            raise RunError(f"evaluation: {len(failed)} held-out {domain} requests failed; first: {failed[0].error}")
        rewards = rollout_rewards(completions, examples, tokenizer, reward_fn, on_bad=on_bad)
        good = rewards[~np.isnan(rewards)]
        out[f"eval/{domain}/accuracy"] = float(good.mean()) if good.size else float("nan")
        if on_bad == "skip":
            out[f"eval/{domain}/bad_samples"] = float(np.isnan(rewards).sum())
    accuracies = [v for k, v in out.items() if k.endswith("/accuracy")]
    if accuracies:
        out["eval/accuracy"] = float(np.mean(accuracies))
    return out


class HeldOutEvaluator:
    """Held-out accuracy of any number of models on one fixed prompt set, greedy through the
    embedded engine at the rollout's precision: how the merge report compares base, experts,
    student and weight-space baselines like for like."""

    def __init__(self, tokenizer: Tokenizer, held_out: dict[str, Sequence[Example]],
                 encode: Callable[[Example], list[int]], *, max_new_tokens: int, stop_token_ids: tuple[int, ...],
                 numerics: EngineNumerics = EngineNumerics(), reward_fn: RewardFn | None = None):
        self.tokenizer, self.held_out, self.encode = tokenizer, held_out, encode
        self.max_new_tokens, self.stop_token_ids, self.numerics, self.reward_fn = (max_new_tokens, stop_token_ids,
                                                                                   numerics, reward_fn)
        longest = max((len(encode(e)) for v in held_out.values() for e in v), default=64)
        self.max_cache_len = longest + max_new_tokens + 16
        self._engines: dict[Any, EngineThread] = {}
        self._version = 0

    def _serve(self, model: Decoder) -> EngineThread:
        """The engine of the model's architecture, serving its weights from now on."""
        served = engine_model(model.config, nnx.state(model, nnx.Param), self.numerics)
        graphdef = nnx.graphdef(served)
        self._version += 1
        if graphdef not in self._engines:
            sampler = Sampler(served, max_cache_len=self.max_cache_len, pad_id=self.tokenizer.pad_token_id or 0,
                              weight_version=self._version, kv_cache_dtype=self.numerics.kv_cache_dtype)
            self._engines[graphdef] = EngineThread(EmbeddedEngine(sampler))
        else:
            self._engines[graphdef].update_weights(WeightUpdate(self._version, model=lambda: served))
        return self._engines[graphdef]

    def __call__(self, model: Decoder, domains: Iterable[str] | None = None) -> dict[str, float]:
        """{domain: accuracy} over `domains` (default: all of the held-out set)."""
        engine = self._serve(model)
        wanted = sorted(self.held_out) if domains is None else sorted(domains)
        accuracy = evaluate(engine, self.tokenizer, {d: self.held_out[d] for d in wanted},
                            self.encode, max_new_tokens=self.max_new_tokens, stop_token_ids=self.stop_token_ids,
                            reward_fn=self.reward_fn)
        return {d: accuracy[f"eval/{d}/accuracy"] for d in wanted}

    def sample(self, model: Decoder, domain: str, sampling: SamplingParams, seed: int) -> list[Rollout | Failure]:
        """One sample of `model` per prompt of `domain` (sampling's temperature and length; the
        stop tokens are the evaluator's), prompt i seeded with seed + i."""
        sampling = dataclasses.replace(sampling, stop_token_ids=self.stop_token_ids)
        requests = [Request(self.encode(e), sampling, {"domain": domain, "example": e}, seed=seed + i)
                    for i, e in enumerate(self.held_out[domain])]
        return self._serve(model).generate(requests)

    def close(self) -> None:
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()


def held_out_evaluator(tokenizer: Tokenizer, policy: Decoder, rollout: RolloutSection, data: DataSection,
                       held_out: dict[str, Sequence[Example]] | None = None) -> HeldOutEvaluator:
    """The evaluator a run of these settings uses: its prompt encoding, stop tokens, answer
    length, engine precision and verifiers, on `held_out` (default: the data's held-out set)."""
    return HeldOutEvaluator(tokenizer, eval_prompts(data) if held_out is None else held_out,
                            functools.partial(encode_prompt, tokenizer=tokenizer, chat_template=data.chat_template),
                            max_new_tokens=rollout.max_new_tokens, stop_token_ids=stop_ids(tokenizer, policy),
                            numerics=EngineNumerics.of(rollout),
                            reward_fn=load_reward_fn(data.reward_fn) if data.reward_fn else None)
