"""Merging models in weight space, the baselines an OPD merge is judged against. Pure.

Both act leaf by leaf on parameter trees of one architecture (experts fine-tuned from one base).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp


def _check(trees: Sequence[Any]) -> None:
    if not trees:
        raise ValueError("no parameter trees to merge")
    if len(trees) > 1:
        chex.assert_trees_all_equal_shapes_and_dtypes(*trees)


def average_weights(experts: Sequence[Any]) -> Any:
    """Uniform weight averaging ("model soup", Wortsman et al. 2022): θ = (1/K) Σ_k θ_k."""
    _check(experts)
    return jax.tree.map(lambda *xs: (sum(x.astype(jnp.float32) for x in xs) / len(xs)).astype(xs[0].dtype), *experts)


def task_arithmetic(base: Any, experts: Sequence[Any], scale: float) -> Any:
    """Task arithmetic (Ilharco et al. 2023): θ = θ_base + λ · Σ_k (θ_k − θ_base), λ = scale.
    λ = 1/K is weight averaging."""
    _check([base, *experts])
    def merge(b, *xs):
        b32 = b.astype(jnp.float32)
        return (b32 + scale * sum(x.astype(jnp.float32) - b32 for x in xs)).astype(b.dtype)
    return jax.tree.map(merge, base, *experts)
