"""The reward of each response: the user's reward function when the config names one, else the
verifier of its example's domain. (A "score" in opd_jax is a log-probability; this is a reward.)"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from opd_jax.data import Example
from opd_jax.data.domains import DOMAINS
from opd_jax.errors import OpdJaxError
from opd_jax.rewards.verifiers import VERIFIERS, RewardFn


class RewardError(OpdJaxError, ValueError):
    """A reward that cannot be trained on; names the sample and its domain."""


def compute_rewards(responses: Sequence[str], examples: Sequence[Example], reward_fn: RewardFn | None = None
                    ) -> np.ndarray:
    """One reward per (decoded) response: reward_fn(prompt, response, answer, domain) when given,
    else the verifier of the example's domain (exact match for domains not built in, numeric when
    the answer is a number). A NaN/inf reward raises RewardError naming the sample and domain."""
    rewards = np.zeros(len(responses), np.float64)
    for i, (text, example) in enumerate(zip(responses, examples, strict=True)):
        if reward_fn is not None:
            value = float(reward_fn(example.prompt or "", text, example.answer, example.domain))
        else:
            value = VERIFIERS[_verifier(example)](text, example.answer)
        if not math.isfinite(value):
            raise RewardError(f"reward of sample {i} (domain {example.domain!r}, prompt {example.uid}) is {value}")
        rewards[i] = value
    return rewards


def _verifier(example: Example) -> str:
    if example.domain in DOMAINS:
        return DOMAINS[example.domain].verifier
    try:
        float(example.answer)
        return "numeric"
    except ValueError:
        return "exact"
