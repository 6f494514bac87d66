"""A user reward function (loaded by import path in the loop tests) that goes NaN on 'max'."""


def reward(prompt: str, response: str, answer: str, domain: str) -> float:
    return float("nan") if domain == "max" else float(response.strip() == answer)


def nan_unless_right(prompt: str, response: str, answer: str, domain: str) -> float:
    """NaN for a wrong response on 'max' (its reference answer scores 1, so it passes the check
    before the run and fails on the rollouts)."""
    right = response.strip() == answer
    return 1.0 if right else float("nan") if domain == "max" else 0.0
