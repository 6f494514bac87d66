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
    replicated = NamedSharding(mesh, PartitionSpec())

    def jit_for(example: Any) -> Callable:
        return jax.jit(step, in_shardings=(state_sh, batch_shardings(example, mesh, rules)),
                       out_shardings=(state_sh, replicated), donate_argnums=(0,) if donate else ())
    return under_mesh(_per_structure(jit_for, batch), mesh, rules)


def sharded_scoring(score: Callable[[Any, Any], Any], state: Any, batch: Any, mesh: Mesh,
                    rules: LogicalRules = DEFAULT_RULES) -> Callable[[Any, Any], Any]:
    """`score` ((state, batch) -> batch, e.g. opd_jax.core.score_batch) jitted over the mesh: the
    state sharded as for the step (and not donated: the step needs it next), the batch split over
    the data axes on the way in and out."""
    state_sh = tree_shardings(state, mesh, rules)

    def jit_for(example: Any) -> Callable:
        out_sh = batch_shardings(jax.eval_shape(score, state, example), mesh, rules)
        return jax.jit(score, in_shardings=(state_sh, batch_shardings(example, mesh, rules)), out_shardings=out_sh)
    return under_mesh(_per_structure(jit_for, batch), mesh, rules)


def _per_structure(jit_for: Callable[[Any], Callable], example: Any) -> Callable:
    """(state, batch) -> jit_for(batch)(state, batch), one jitted function per batch structure: a
    batch's static fields (a packed batch's layout) are part of it, and each needs its own
    in_shardings. The first is built from `example`, the others as batches bring them."""
    jitted = {jax.tree.structure(example): jit_for(example)}

    @functools.wraps(next(iter(jitted.values())))
    def call(state: Any, batch: Any) -> Any:
        key = jax.tree.structure(batch)
        if key not in jitted:
            jitted[key] = jit_for(batch)
        return jitted[key](state, batch)
    return call


def under_mesh(jitted: Callable, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES) -> Callable:
    """Call (and so trace) `jitted` with the mesh set and the logical rules in force, so any
    `flax.linen.with_logical_constraint` inside a user's step resolves against them."""
    @functools.wraps(jitted)
    def call(*args, **kwargs):
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            return jitted(*args, **kwargs)
    return call
