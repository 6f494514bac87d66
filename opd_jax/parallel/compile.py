"""Jit a (state, batch) -> (state, metrics) step over a mesh: explicit in/out shardings from the
logical-axis rules, the state donated, traced under the same rules and mesh."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from opd_jax.parallel.rules import DEFAULT_RULES, LogicalRules, batch_shardings, tree_shardings


def sharded_step(step: Callable[[Any, Any], tuple[Any, Any]], state: Any, batch: Any, mesh: Mesh,
                 rules: LogicalRules = DEFAULT_RULES, *, donate: bool = True) -> Callable[[Any, Any], tuple[Any, Any]]:
    """`step` jitted with the state sharded by its parameters' logical axes, the batch split over
    the data axes, metrics replicated, and the input state's buffers donated to the output.
    `state` and `batch` are examples (shapes and structure only). Call the result with arrays
    placed by `shard(x, state_shardings(...))` / `shard(batch, batch_shardings(...))`."""
    state_sh = tree_shardings(state, mesh, rules)
    batch_sh = batch_shardings(batch, mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())

    def traced(state, batch):
        with nn.logical_axis_rules(rules):
            return step(state, batch)

    jitted = jax.jit(traced, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, replicated),
                     donate_argnums=(0,) if donate else ())

    @functools.wraps(step)
    def call(state, batch):
        with jax.set_mesh(mesh):
            return jitted(state, batch)

    call.lower = lambda state, batch: _lower(jitted, mesh, state, batch)  # type: ignore[attr-defined]
    return call


def _lower(jitted, mesh: Mesh, state: Any, batch: Any):
    with jax.set_mesh(mesh):
        return jitted.lower(state, batch)
