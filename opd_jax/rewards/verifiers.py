"""Verifiers: the reward of a response given the reference answer, per domain, plus user reward
functions loaded by import path."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

RewardFn = Callable[[str, str, str, str], float]  # (prompt, response, answer, domain) -> reward

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_match(response: str, answer: str) -> float:
    """1 if the response, up to its first newline and without surrounding spaces, is the answer."""
    return float(response.split("\n", 1)[0].strip() == answer.strip())


def numeric_match(response: str, answer: str) -> float:
    """1 if the last number in the response equals the answer's number (e.g. '... so 12.' vs '12')."""
    found = _NUMBER.findall(response.replace(",", ""))
    if not found:
        return 0.0
    try:
        return float(abs(float(found[-1]) - float(answer)) < 1e-6)
    except ValueError:
        return 0.0


VERIFIERS: dict[str, Callable[[str, str], float]] = {"exact": exact_match, "numeric": numeric_match}


def load_reward_fn(path: str) -> RewardFn:
    """'package.module:function' -> the function, called as f(prompt, response, answer, domain)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function {path!r} must be given as 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward function {path!r}: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function {path!r}: {module_name!r} has no callable {attr!r}")
    return fn
