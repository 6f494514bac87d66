"""Held-out accuracy per domain: greedy decoding through the engine, scored by the verifiers."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from opd_jax.data import Example
from opd_jax.models import Tokenizer
from opd_jax.rewards import RewardFn
from opd_jax.train.batching import RewardError, score_rollouts
from rollout_bridge.pipe import EngineThread
from rollout_bridge.records import Failure, Request, SamplingParams


def evaluate(engine: EngineThread, tokenizer: Tokenizer, held_out: dict[str, Sequence[Example]],
             encode: Callable[[Example], list[int]], *, max_new_tokens: int, stop_token_ids: tuple[int, ...],
             reward_fn: RewardFn | None = None) -> dict[str, float]:
    """{"eval/<domain>/accuracy": mean reward of greedy answers, ..., "eval/accuracy": the mean
    over domains}. A request the engine could not serve stops the evaluation with its error."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stop_token_ids)
    out: dict[str, float] = {}
    for domain, examples in sorted(held_out.items()):
        completions = engine.generate([Request(encode(e), params, {"domain": domain}) for e in examples])
        failed = [c for c in completions if isinstance(c, Failure)]
        if failed:
            raise RewardError(f"{len(failed)} held-out {domain} requests failed; first: {failed[0].error}")
        out[f"eval/{domain}/accuracy"] = float(np.mean(score_rollouts(completions, examples, tokenizer, reward_fn)))
    out["eval/accuracy"] = float(np.mean(list(out.values()))) if out else 0.0
    return out
