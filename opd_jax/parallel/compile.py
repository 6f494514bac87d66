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
    return under_mesh(_per_structure(functools.partial(step_jit, step, state, mesh=mesh, rules=rules, donate=donate),
                                     batch), mesh, rules)


def step_jit(step: Callable[[Any, Any], tuple[Any, Any]], state: Any, batch: Any, mesh: Mesh,
             rules: LogicalRules = DEFAULT_RULES, *, donate: bool = True) -> Any:
    """The jax.jit of `sharded_step` for batches structured as `batch` (not yet under the mesh)."""
    state_sh = tree_shardings(state, mesh, rules)
    return jax.jit(step, in_shardings=(state_sh, batch_shardings(batch, mesh, rules)),
                   out_shardings=(state_sh, NamedSharding(mesh, PartitionSpec())), donate_argnums=(0,) if donate else ())


def sharded_scoring(score: Callable[[Any, Any], Any], state: Any, batch: Any, mesh: Mesh,
                    rules: LogicalRules = DEFAULT_RULES) -> Callable[[Any, Any], Any]:
    """`score` ((state, batch) -> batch, e.g. opd_jax.core.score_batch) jitted over the mesh: the
    state sharded as for the step (and not donated: the step needs it next), the batch split over
    the data axes on the way in and out."""
    return under_mesh(_per_structure(functools.partial(scoring_jit, score, state, mesh=mesh, rules=rules), batch),
                      mesh, rules)


def scoring_jit(score: Callable[[Any, Any], Any], state: Any, batch: Any, mesh: Mesh,
                rules: LogicalRules = DEFAULT_RULES) -> Any:
    """The jax.jit of `sharded_scoring` for batches structured as `batch` (not yet under the mesh)."""
    out_sh = batch_shardings(jax.eval_shape(score, state, batch), mesh, rules)
    return jax.jit(score, in_shardings=(tree_shardings(state, mesh, rules), batch_shardings(batch, mesh, rules)),
                   out_shardings=out_sh)


def compile_abstract(jitted: Any, mesh: Mesh, *args: Any, rules: LogicalRules = DEFAULT_RULES) -> jax.stages.Compiled:
    """`jitted` (a step_jit / scoring_jit) compiled ahead of time for `args`, arrays or their
    shapes alone (jax.ShapeDtypeStruct: nothing allocated), traced under the mesh and rules."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        return jitted.lower(*args).compile()


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
