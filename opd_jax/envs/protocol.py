"""What an environment is to opd_jax: created per episode from a seed, it gives the first
observation, takes the model's turns and answers each with the next observation, that turn's
reward and whether the episode is over.

    env = make(seed, split, **params)         # split: "train" or "eval" (held-out episodes)
    observation = env.reset()                 # str, chat messages, or token ids
    result = env.step(Turn(text, token_ids))  # StepResult(observation, reward, done, truncated, info)

`reset` and `step` may be plain or `async` functions. A plain one runs in a worker thread, so a
slow environment does not stall the others. `done` ends the episode (its value is 0 from there
on); `truncated` stops it early (out of moves, say) and the critic's value of where it stopped
stands in for the rest. `info["success"]` (a bool) is what held-out success counts; without it,
success means a positive total reward. An optional `expert()` returns the next turn's text of a
good player, which the supervised warm start imitates.

Held-out episodes differ from training ones by content (opd_jax.data.splits). An environment
class may say what its content is: `problem_key()` (a string; episodes with equal keys are the
same problem, like a map or a secret) and `problem_space(**params)` (how many distinct episodes
there are, named when a split asks for more). Without `problem_key`, the episode seed stands for
the content, so two seeds that build the same episode count as two problems.

Users plug their own by import path, `data.train: [{environment: "my_pkg.envs:make"}]`, as
reward functions are plugged; built-in ones by name (`calculator`, `gridworld`, `search`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from opd_jax.errors import OpdJaxError
from opd_jax.plugins import import_callable

Message = dict[str, str]
Observation = str | Sequence[Message] | Sequence[int]


class EnvError(OpdJaxError, ValueError):
    """An environment that cannot be loaded or that broke its contract; names it and the episode."""


@dataclasses.dataclass(frozen=True)
class Turn:
    """The model's turn as the environment sees it: the decoded text and the engine's token ids
    (the stop token included when the model produced one)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str = "stop"  # "length": the turn hit its token budget


@dataclasses.dataclass(frozen=True)
class StepResult:
    observation: Observation | None = None
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    def reset(self) -> Any:
        """The first observation (or an awaitable of it)."""
        ...

    def step(self, turn: Turn) -> Any:
        """The StepResult of the model's turn (or an awaitable of it)."""
        ...


EnvironmentFactory = Callable[..., Environment]


def builtin_environments() -> dict[str, EnvironmentFactory]:
    from opd_jax.envs.calculator import CalculatorEnv
    from opd_jax.envs.gridworld import GridworldEnv
    from opd_jax.envs.search import SearchEnv

    return {"calculator": CalculatorEnv, "gridworld": GridworldEnv, "search": SearchEnv}


def load_environment(name: str) -> EnvironmentFactory:
    """A built-in environment by name, or a user's factory by 'module:attribute'."""
    builtins = builtin_environments()
    if name in builtins:
        return builtins[name]
    if ":" not in name:
        raise EnvError(f"environment {name!r} is neither built in ({', '.join(sorted(builtins))}) "
                       f"nor a 'module:factory' import path")
    try:
        return import_callable(name, "environment", "module:factory")
    except ValueError as e:
        raise EnvError(str(e)) from None


def episode_factory(spec: Any) -> Callable[[], Environment]:
    """What creates the environment of one episode (an opd_jax.data EpisodeSpec: its environment,
    parameters, seed and split)."""
    factory = load_environment(spec.environment)
    return lambda: factory(spec.seed, spec.split, **spec.params)


def check_environment(name: str, params: dict[str, Any]) -> None:
    """Load the environment and create one episode with these parameters, so a wrong name or
    parameter is named when the config is read (EnvError), not mid-run."""
    factory = load_environment(name)
    try:
        factory(0, "train", **params)
    except (TypeError, ValueError) as e:
        raise EnvError(f"environment {name!r} does not take the parameters {params}: {e}") from None


def check_result(result: Any) -> StepResult:
    """The step's result if it is a StepResult of the right types, else EnvError saying
    what is wrong with it."""
    if not isinstance(result, StepResult):
        raise EnvError(f"step returned {type(result).__name__}, not a StepResult")
    if isinstance(result.reward, bool) or not isinstance(result.reward, (int, float)) or result.reward != result.reward \
            or abs(result.reward) == float("inf"):
        raise EnvError(f"step returned the reward {result.reward!r}; it must be a finite number")
    if not result.done and not result.truncated:
        check_observation(result.observation)
    return result


def check_observation(observation: Any) -> Observation:
    """A str, a non-empty list of {role, content} messages, or a non-empty list of token ids;
    anything else raises EnvError naming what came."""
    if isinstance(observation, str):
        if not observation:
            raise EnvError("the observation is an empty string")
        return observation
    if isinstance(observation, (list, tuple)) and observation:
        if all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
               for m in observation):
            return observation
        if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in observation):
            return observation
    raise EnvError(f"the observation {observation!r:.80} is not text, chat messages or token ids")
