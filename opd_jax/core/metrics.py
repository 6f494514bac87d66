"""How a step metric is reduced, declared where the metric is made. Pure.

A metric is a scalar array (a token mean: micro-batches combine weighted by their token counts,
updates by their mean), or wrapped:

    Summed(x): micro-batch values add up (a loss term already divided by the whole mini-batch's
               normalizer, a count); updates average
    Maxed(x):  the maximum over micro-batches and over updates
    First(x):  a token mean over micro-batches; of the updates, the first's (a figure of the
               policy before this step moved it)

Steps return plain arrays (`unwrap`), so callers never see the wrappers."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


class _Reduced:
    """A metric value with its reduction; reads as its number (float(), np.asarray())."""

    value: jax.Array

    def __float__(self) -> float:
        return float(self.value)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self.value, dtype)


@flax.struct.dataclass
class Summed(_Reduced):
    value: jax.Array


@flax.struct.dataclass
class Maxed(_Reduced):
    value: jax.Array


@flax.struct.dataclass
class First(_Reduced):
    value: jax.Array


Metrics = dict[str, Any]


def combine_microbatches(per_micro: Metrics, counts: jax.Array) -> Metrics:
    """Micro-batch metrics [n] combined as one batch would give them: Summed add, Maxed max,
    plain ones by token count (counts [n])."""
    total = jnp.maximum(jnp.sum(counts), 1.0)
    out: Metrics = {}
    for name, m in per_micro.items():
        if isinstance(m, Summed):
            out[name] = Summed(jnp.sum(m.value))
        elif isinstance(m, Maxed):
            out[name] = Maxed(jnp.max(m.value))
        elif isinstance(m, First):
            out[name] = First(jnp.sum(m.value * counts) / total)
        else:
            out[name] = jnp.sum(m * counts) / total
    return out


def combine_updates(per_update: Metrics) -> Metrics:
    """Metrics of every update of a step (leading axes: epochs × mini-batches) as one number
    each, unwrapped: Maxed the maximum, First the first update's, the others the mean."""
    def one(m: Any) -> jax.Array:
        if isinstance(m, Maxed):
            return jnp.max(m.value)
        if isinstance(m, First):
            return jnp.reshape(m.value, (-1,))[0]
        return jnp.mean(unwrap(m))
    return {name: one(m) for name, m in per_update.items()}


def unwrap(m: Any) -> jax.Array:
    return m.value if isinstance(m, _Reduced) else m


def prefixed(prefix: str, metrics: Metrics) -> Metrics:
    return {f"{prefix}{k}": v for k, v in metrics.items()}
