"""Built-in procedurally generated domains with verifiable answers, for training tiny models from
scratch and for the multi-domain OPD merge. Each domain draws (prompt, answer) from a NumPy
generator, so example i of a seeded stream is the same on every host and after every resume.

Prompts end with the separator the answer follows; answers are short plain text. The verifier
(opd_jax.rewards) compares the model's response with the answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

Sampler = Callable[[np.random.Generator], tuple[str, str]]


@dataclasses.dataclass(frozen=True)
class EpisodeSpec:
    """One episode of an environment (opd_jax.envs): built-in name or 'module:factory', its
    parameters, and the seed and split it is created with."""

    environment: str
    params: dict[str, Any]
    seed: int
    split: str = "train"


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt: text (or chat messages), the reference answer, and its domain (OPD routes
    each prompt to its domain's teacher); or one episode of an environment (`episode`), whose
    prompt is the environment's first observation and whose reward the environment gives."""

    prompt: str | None
    answer: str
    domain: str
    messages: tuple[dict[str, str], ...] | None = None
    uid: str = ""
    episode: EpisodeSpec | None = None
    verifier: str | None = None  # exact, numeric or math; None: the domain's, or numeric/exact by the answer


@dataclasses.dataclass(frozen=True)
class Domain:
    name: str
    verifier: str  # "exact" or "numeric", see opd_jax.rewards
    make: Callable[..., Sampler]
    description: str
    space_rule: str = ""  # how many distinct prompts it has, as a formula of its parameters

    def sampler(self, **params: Any) -> Sampler:
        try:
            return self.make(**params)
        except TypeError as e:
            raise ValueError(f"domain {self.name!r} does not take these parameters {sorted(params)}: {e}") from None


def _sized(sample: Sampler, space: int) -> Sampler:
    """The sampler, knowing how many distinct prompts it can draw (its problem space)."""
    sample.space = space
    return sample


def _numbers(rng, count, lo, hi):
    return [int(x) for x in rng.integers(lo, hi + 1, count)]


def _addition(digits: int = 2):
    def sample(rng):
        a, b = _numbers(rng, 2, 0, 10**digits - 1)
        return f"{a}+{b}=", str(a + b)
    return _sized(sample, (10**digits) ** 2)


def _multiplication(digits: int = 1):
    def sample(rng):
        a, b = _numbers(rng, 2, 0, 10**digits - 1)
        return f"{a}*{b}=", str(a * b)
    return _sized(sample, (10**digits) ** 2)


def _reverse(min_len: int = 3, max_len: int = 6):
    def sample(rng):
        s = "".join(map(str, _numbers(rng, int(rng.integers(min_len, max_len + 1)), 0, 9)))
        return f"reverse {s}:", s[::-1]
    return _sized(sample, sum(10**n for n in range(min_len, max_len + 1)))


def _sort(min_len: int = 3, max_len: int = 5):
    def sample(rng):
        xs = _numbers(rng, int(rng.integers(min_len, max_len + 1)), 0, 9)
        return f"sort {' '.join(map(str, xs))}:", " ".join(map(str, sorted(xs)))
    return _sized(sample, sum(10**n for n in range(min_len, max_len + 1)))


def _count(min_len: int = 4, max_len: int = 8, letters: str = "ab"):
    def sample(rng):
        s = "".join(rng.choice(list(letters), int(rng.integers(min_len, max_len + 1))))
        target = letters[0]
        return f"count {target} in {s}:", str(s.count(target))
    return _sized(sample, sum(len(letters) ** n for n in range(min_len, max_len + 1)))


def _parity(min_len: int = 3, max_len: int = 8):
    def sample(rng):
        bits = "".join(map(str, _numbers(rng, int(rng.integers(min_len, max_len + 1)), 0, 1)))
        return f"parity {bits}:", "odd" if bits.count("1") % 2 else "even"
    return _sized(sample, sum(2**n for n in range(min_len, max_len + 1)))


def _maximum(min_len: int = 3, max_len: int = 5, hi: int = 99):
    def sample(rng):
        xs = _numbers(rng, int(rng.integers(min_len, max_len + 1)), 0, hi)
        return f"max {' '.join(map(str, xs))}:", str(max(xs))
    return _sized(sample, sum((hi + 1) ** n for n in range(min_len, max_len + 1)))


def _copy_edit(min_len: int = 4, max_len: int = 7):
    def sample(rng):
        alphabet = list("abcdefgh")
        s = "".join(rng.choice(alphabet, int(rng.integers(min_len, max_len + 1))))
        old = s[int(rng.integers(0, len(s)))]
        new = str(rng.choice([c for c in "xyz"]))
        return f"copy {s} with {old}->{new}:", s.replace(old, new)
    # (string, a letter it holds, x/y/z): each of the 8 letters is in 8^n - 7^n strings of length n
    return _sized(sample, sum(8 * (8**n - 7**n) * 3 for n in range(min_len, max_len + 1)))


def _chain(steps: int = 3, hi: int = 9):
    def sample(rng):
        value = int(rng.integers(0, hi + 1))
        text = str(value)
        for _ in range(steps):
            op, x = str(rng.choice(["+", "-", "*"])), int(rng.integers(0, hi + 1))
            value = value + x if op == "+" else value - x if op == "-" else value * x
            text += f"{op}{x}"
        return f"chain {text}=", str(value)
    return _sized(sample, (hi + 1) * (3 * (hi + 1)) ** steps)


def _long_count(min_span: int = 8, max_span: int = 16, hi: int = 50):
    """A long answer whose only reward comes at its end: every number from a to b."""
    def sample(rng):
        a = int(rng.integers(0, hi))
        b = a + int(rng.integers(min_span, max_span + 1))
        return f"list {a} to {b}:", " ".join(str(i) for i in range(a, b + 1))
    return _sized(sample, hi * (max_span - min_span + 1))


_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana"]
_ITEMS = ["apples", "books", "coins", "marbles", "pencils", "stamps"]


def _word_problems(hi: int = 20):
    """Arithmetic word problems for pretrained instruct models; the answer is a number."""
    def sample(rng):
        name, item = str(rng.choice(_NAMES)), str(rng.choice(_ITEMS))
        a, b = _numbers(rng, 2, 1, hi)
        kind = int(rng.integers(0, 3))
        if kind == 0:
            return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", str(a + b)
        if kind == 1:
            a, b = max(a, b), min(a, b)
            return f"{name} has {a} {item} and gives away {b}. How many {item} are left?", str(a - b)
        return f"{name} buys {a} boxes with {b} {item} in each. How many {item} is that in all?", str(a * b)
    # name x item x (a, b) for "gets more" and "buys", (larger, smaller) for "gives away"
    return _sized(sample, len(_NAMES) * len(_ITEMS) * (2 * hi * hi + hi * (hi + 1) // 2))


DOMAINS: dict[str, Domain] = {d.name: d for d in (
    Domain("addition", "exact", _addition, "a+b= with `digits`-digit operands", "(10^digits)^2"),
    Domain("multiplication", "exact", _multiplication, "a*b= with `digits`-digit operands", "(10^digits)^2"),
    Domain("reverse", "exact", _reverse, "reverse a digit string", "Σ 10^n, n = min_len..max_len"),
    Domain("sort", "exact", _sort, "sort single digits ascending", "Σ 10^n, n = min_len..max_len"),
    Domain("count", "exact", _count, "count one letter in a string", "Σ len(letters)^n, n = min_len..max_len"),
    Domain("parity", "exact", _parity, "odd or even number of 1 bits", "Σ 2^n, n = min_len..max_len"),
    Domain("max", "exact", _maximum, "the largest of a few numbers", "Σ (hi+1)^n, n = min_len..max_len"),
    Domain("copy_edit", "exact", _copy_edit, "copy a string replacing one letter", "Σ 3·8·(8^n − 7^n), n = min_len..max_len"),
    Domain("chain", "exact", _chain, "left-to-right multi-step arithmetic", "(hi+1)·(3·(hi+1))^steps"),
    Domain("long_count", "exact", _long_count, "list every number from a to b (long answer, reward at the end)",
           "hi·(max_span − min_span + 1)"),
    Domain("word_problems", "numeric", _word_problems, "arithmetic word problems (for pretrained models)",
           "48·(2·hi² + hi·(hi+1)/2)"),
)}


def get_domain(name: str) -> Domain:
    if name not in DOMAINS:
        raise ValueError(f"unknown built-in domain {name!r}; known: {', '.join(DOMAINS)}")
    return DOMAINS[name]
