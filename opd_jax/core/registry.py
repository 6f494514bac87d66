"""Registered algorithm parts: advantage estimators, policy losses and mismatch corrections, each
registered once with its function and what it needs. The config's names, its validation and
error messages, `opd-jax config explain`, docs/config.md and the steps read these registries;
nothing else lists them.

    @ADVANTAGE_ESTIMATORS.register("grpo", needs=("group",))
    def grpo(inputs: AdvantageInputs, config) -> jax.Array: ...     # [B, T] advantages

A user's own part is named by import path ('package.module:function') wherever a built-in name
is accepted; `part(needs=...)` declares what it needs without registering a name:

    @part(needs=("critic",))
    def my_estimator(inputs, config, *, scale=1.0): ...            # algorithm.ppo.advantage: my_pkg:my_estimator

What a part may need (its `needs`):
    critic      the learned value model: its values and returns (only then is one built and trained)
    group       the run's samples per prompt, as consecutive rows (a group baseline)
    pairs       at least 2 samples per prompt (a leave-one-out baseline)
    sequence    a whole response's statistics (its tokens are weighted together)
    current     the policy being updated, inside the loss (a correction recomputed per update)
    dual-clip   a policy loss that the dual clip applies to
    band        a correction with a lower bound lo (default 1/hi when also `symmetric`)
    symmetric   the default band is [1/hi, hi]
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import jax

from opd_jax.plugins import import_callable

NEEDS = frozenset({"critic", "group", "pairs", "sequence", "current", "dual-clip", "band", "symmetric"})


@dataclasses.dataclass(frozen=True)
class Part:
    """One registered function and what it needs (see the module docstring)."""

    name: str
    fn: Callable[..., Any]
    needs: frozenset[str]

    @property
    def summary(self) -> str:
        """The first line of the function's docstring."""
        return (inspect.getdoc(self.fn) or "").split("\n")[0]

    def check_params(self, params: dict[str, Any], fixed: int) -> None:
        """ValueError unless `params` bind to the function's keyword parameters after its `fixed`
        positional ones."""
        try:
            signature = inspect.signature(self.fn)
        except (TypeError, ValueError):
            return
        try:
            signature.bind(*([None] * fixed), **params)
        except TypeError as e:
            accepted = [p for p in list(signature.parameters)[fixed:]]
            raise ValueError(f"{self.name} does not take parameters {sorted(params)} ({e}); it takes "
                             f"{', '.join(accepted) or 'none'}") from None


def part(needs: Iterable[str] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare what a user's function (named by import path) needs; it stays unregistered."""
    declared = _checked_needs(needs)

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.__opd_jax_needs__ = declared  # type: ignore[attr-defined]
        return fn
    return mark


def _checked_needs(needs: Iterable[str]) -> frozenset[str]:
    declared = frozenset(needs)
    unknown = declared - NEEDS
    if unknown:
        raise ValueError(f"unknown needs {sorted(unknown)}; a part may need {', '.join(sorted(NEEDS))}")
    return declared


class Registry:
    """Parts of one kind by name; `get` also resolves 'module:function' import paths."""

    def __init__(self, kind: str, key: str):
        self.kind, self.key = kind, key  # "advantage estimator", "ppo.advantage": the end of the config keys naming one
        self._parts: dict[str, Part] = {}

    def register(self, name: str, *, needs: Iterable[str] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        declared = _checked_needs(needs)

        def add(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._parts and self._parts[name].fn is not fn:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._parts[name] = Part(name, fn, declared)
            return fn
        return add

    @property
    def field(self) -> str:
        """The config field that names a part."""
        return self.key.rpartition(".")[2]

    def names(self) -> tuple[str, ...]:
        import opd_jax.core.algorithms  # noqa: F401
        return tuple(self._parts)

    def get(self, name: str) -> Part:
        """The part registered as `name`, or the function at import path `name`; ValueError
        naming the key and the registered names otherwise."""
        if name in self._parts:
            return self._parts[name]
        if ":" not in name:
            import opd_jax.core.algorithms  # noqa: F401  (registers the algorithm files' parts)
            if name in self._parts:
                return self._parts[name]
            raise ValueError(f"{self.field}: unknown {self.kind} {name!r}; choose one of {', '.join(self._parts)} or "
                             f"give 'module:function'")
        try:
            fn = import_callable(name, self.kind)
        except ValueError as e:
            raise ValueError(f"{self.field}: {e}") from None
        return Part(name, fn, frozenset(getattr(fn, "__opd_jax_needs__", frozenset())))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator reads, per sample [B] or per token [B, T] (zero off the mask).

    rewards: each sample's outcome reward [B]; token_rewards: the reward on each token [B, T]
    (the outcome on the last response token, or a multi-turn episode's per-turn rewards; minus
    the KL penalty when kl.where is "reward"); mask: the response tokens [B, T]; values: the
    critic's θ_old values [B, T] and final_values: its value where a truncated episode stopped
    [B] (None for an estimator that does not need the critic; final_values also None when
    nothing bootstraps); group_size: the run's samples per prompt (consecutive rows)."""

    rewards: jax.Array
    token_rewards: jax.Array
    mask: jax.Array
    values: jax.Array | None
    final_values: jax.Array | None
    group_size: int = dataclasses.field(metadata={"static": True})


ADVANTAGE_ESTIMATORS = Registry("advantage estimator", "ppo.advantage")
"""fn(inputs: AdvantageInputs, config: PPOConfig, **advantage_params) -> advantages [B, T]."""

POLICY_LOSSES = Registry("policy loss", "surrogate.kind")
"""fn(logp, logp_old, advantages, mask, eps_low, eps_high) -> (per-token loss [B, T] before the
mismatch weight, ratio [B, T]); `policy_loss` weights, dual-clips and aggregates it."""

MISMATCH_CORRECTIONS = Registry("mismatch correction", "mismatch.kind")
"""fn(log_k, on, correction, inputs) -> weights [B, T]: log_k = log-ratio of the trainer's (θ_old,
or the current policy for a part that needs `current`) to the engine's probability on each
token, 0 off the mask `on`; inputs: CorrectionInputs."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CorrectionInputs:
    """What a correction may read besides the log-ratio: the advantages [B, T] (None before
    they are known)."""

    advantages: jax.Array | None = None
