"""User reward functions that misbehave (loaded by import path in the safe-run tests)."""


def none_on_odd_length(prompt: str, response: str, answer: str, domain: str):
    """None (not a number) for a response of odd length; exact match otherwise."""
    return None if len(response) % 2 else float(response.strip() == answer)


def raises(prompt: str, response: str, answer: str, domain: str) -> float:
    raise KeyError("score_table")


def two_arguments(prompt: str, response: str) -> float:
    """A mistake: the reward function's arity (it is called with prompt, response, answer, domain)."""
    return 0.0
