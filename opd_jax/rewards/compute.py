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


def _name(fn: RewardFn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _call(reward_fn: RewardFn, text: str, example: Example) -> float:
    where = f"sample {example.uid} (domain {example.domain!r})"
    try:
        value = reward_fn(example.prompt or "", text, example.answer, example.domain)
    except Exception as e:  # the user's code: whatever it raises names it and the sample
        raise RewardError(f"reward function {_name(reward_fn)} raised {type(e).__name__}: {e} on {where}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise RewardError(f"reward function {_name(reward_fn)} returned {value!r} ({type(value).__name__}) on {where}; "
                          f"it must return a number")
    return float(value)


def compute_rewards(responses: Sequence[str], examples: Sequence[Example], reward_fn: RewardFn | None = None, *,
                    on_bad: str = "fail") -> np.ndarray:
    """One reward per (decoded) response: reward_fn(prompt, response, answer, domain) when given,
    else the verifier of the example's domain (exact match for domains not built in, numeric when
    the answer is a number). A reward function that raises or returns a non-number, or a NaN/inf
    reward, is a bad sample: on_bad "fail" raises RewardError naming the function and the sample,
    "skip" gives it the reward NaN (the caller drops it)."""
    rewards = np.zeros(len(responses), np.float64)
    for i, (text, example) in enumerate(zip(responses, examples, strict=True)):
        try:
            if reward_fn is not None:
                value = _call(reward_fn, text, example)
            else:
                value = VERIFIERS[_verifier(example)](text, example.answer)
            if not math.isfinite(value):
                source = f"reward function {_name(reward_fn)}" if reward_fn is not None else \
                    f"the {_verifier(example)} verifier"
                raise RewardError(f"reward of sample {i} (domain {example.domain!r}, prompt {example.uid}) is {value}, "
                                  f"returned by {source}")
        except RewardError:
            if on_bad == "fail":
                raise
            value = math.nan
        rewards[i] = value
    return rewards


def _verifier(example: Example) -> str:
    if example.verifier is not None:
        return example.verifier
    if example.domain in DOMAINS:
        return DOMAINS[example.domain].verifier
    try:
        float(example.answer)
        return "numeric"
    except ValueError:
        return "exact"
