"""Verifiers: the reward of a response given the reference answer, per domain, plus user reward
functions loaded by import path."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal

from opd_jax.plugins import import_callable

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


def math_match(response: str, answer: str) -> float:
    """1 if the response's final answer is mathematically the reference answer, as the
    `math-verify` package judges it: \\boxed{...} first, else the last expression; LaTeX,
    fractions, decimals and plain numbers compared as values (e.g. \\boxed{\\frac{1}{2}} vs 0.5)."""
    import threading

    from math_verify import parse, verify

    # its timeouts use SIGALRM, which only the main thread may set
    main = threading.current_thread() is threading.main_thread()
    gold = parse(answer if "$" in answer else f"${answer}$", parsing_timeout=5 if main else None)
    found = parse(response, parsing_timeout=5 if main else None)
    return float(bool(gold) and bool(found) and verify(gold, found, timeout_seconds=5 if main else None))


VERIFIERS: dict[str, Callable[[str, str], float]] = {"exact": exact_match, "numeric": numeric_match, "math": math_match}
VerifierName = Literal[tuple(VERIFIERS)]  # type: ignore[valid-type]  (the config's choices: these, once)


def load_reward_fn(path: str) -> RewardFn:
    """'package.module:function' -> the function, called as f(prompt, response, answer, domain)."""
    return import_callable(path, "reward function")
