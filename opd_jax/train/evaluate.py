"""Held-out accuracy per domain: greedy decoding through the engine, scored by the verifiers."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from opd_jax.data import Example
from opd_jax.models import Tokenizer
from opd_jax.rewards import RewardFn
from opd_jax.train.batching import score_rollouts
from rollout_bridge.records import SamplingParams


def evaluate(engine, tokenizer: Tokenizer, held_out: dict[str, Sequence[Example]], encode, *,
             max_new_tokens: int, stop_token_ids: tuple[int, ...], reward_fn: RewardFn | None = None
             ) -> dict[str, float]:
    """{"eval/<domain>/accuracy": mean reward of greedy answers, ..., "eval/accuracy": the mean
    over domains}. `engine` is anything with the rollout engine's generate()."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stop_token_ids)
    out: dict[str, float] = {}
    for domain, examples in sorted(held_out.items()):
        rollouts = engine.generate([encode(e) for e in examples], params, jax.random.key(0))
        out[f"eval/{domain}/accuracy"] = float(np.mean(score_rollouts(rollouts, examples, tokenizer, reward_fn)))
    out["eval/accuracy"] = float(np.mean(list(out.values()))) if out else 0.0
    return out
