"""A user reward function (loaded by import path in the loop tests) that goes NaN on 'max'."""


def reward(prompt: str, response: str, answer: str, domain: str) -> float:
    return float("nan") if domain == "max" else float(response.strip() == answer)
