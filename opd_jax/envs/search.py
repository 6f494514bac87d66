"""The search game: guess a hidden number from "higher" / "lower" feedback.

    guess 0-15          (first observation)
    7                   (the model's turn)
    higher 8-15         (with hints, the feedback restates the interval still possible)
    11
    correct             (reward 1, done)

Reward 1 for finding the number within `max_guesses`, 0 otherwise; an answer that is not a
number counts as a guess and is told so. Bisection needs at most ceil(log2(hi + 1)) guesses.
"""

from __future__ import annotations

import re

import numpy as np

from opd_jax.envs.protocol import StepResult, Turn

SPLITS = {"train": 0, "eval": 1}


class SearchEnv:
    name = "search"

    def __init__(self, seed: int, split: str = "train", hi: int = 15, max_guesses: int = 6, hints: bool = True):
        if hi < 1 or max_guesses < 1:
            raise ValueError(f"search needs hi >= 1 and max_guesses >= 1, got hi={hi}, max_guesses={max_guesses}")
        rng = np.random.default_rng([seed, SPLITS[split]])
        self.secret = int(rng.integers(0, hi + 1))
        self.lo, self.hi, self.max_guesses, self.hints = 0, hi, max_guesses, hints
        self.guesses = 0

    @staticmethod
    def problem_space(hi: int = 15, **_: object) -> int:
        """Distinct episodes: one per secret."""
        return hi + 1

    def problem_key(self) -> str:
        """The episode's content (held-out splits keep equal ones apart): its secret and range."""
        return f"secret {self.secret} of 0-{self.hi}"

    def reset(self) -> str:
        return f"guess {self.lo}-{self.hi}\n"

    def step(self, turn: Turn) -> StepResult:
        self.guesses += 1
        match = re.fullmatch(r"\s*(\d+)\s*", turn.text)
        out_of_guesses = self.guesses >= self.max_guesses
        if match is None:
            feedback = "a number please"
        else:
            guess = int(match.group(1))
            if guess == self.secret:
                return StepResult(reward=1.0, done=True, info={"success": True, "guesses": self.guesses})
            if guess < self.secret:
                feedback, self.lo = "higher", max(self.lo, guess + 1)
            else:
                feedback, self.hi = "lower", min(self.hi, guess - 1)
        if out_of_guesses:
            return StepResult(done=True, info={"success": False, "guesses": self.guesses})
        return StepResult(observation=f"{feedback} {self.lo}-{self.hi}\n" if self.hints else f"{feedback}\n")

    def expert(self) -> str:
        """Bisection: the middle of what is still possible."""
        return str((self.lo + self.hi) // 2)
