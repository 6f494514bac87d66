"""The update machinery every training step shares (PPO, OPD): strided row slices, micro-batch
gradient accumulation that reduces exactly as one big batch would, and an optimizer update that
is skipped when a gradient is not finite. Pure.

Slice j of n holds rows j, j+n, j+2n, ..., so a batch sharded over rows stays evenly spread over
the devices in every slice; shuffle rows before a step if you want random mini-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax


def check_batch_split(batch_size: int, minibatches: int, microbatches: int, group_size: int | None = None) -> None:
    """A batch must split into whole mini- and micro-batches (and whole groups, when a group
    baseline needs them); ValueError saying which does not."""
    if group_size is not None and batch_size % group_size:
        raise ValueError(f"batch of {batch_size} samples is not a whole number of groups of {group_size}")
    if batch_size % (minibatches * microbatches):
        raise ValueError(f"batch of {batch_size} samples does not split into {minibatches} mini-batches"
                         f" x {microbatches} micro-batches")


def split_rows(x: jax.Array, n: int) -> jax.Array:
    """[B, ...] -> [n, B/n, ...], slice j holding rows j, j+n, j+2n, ... (strided)."""
    return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)


def merge_rows(x: jax.Array) -> jax.Array:
    """Inverse of split_rows: [n, B/n, ...] -> [B, ...]."""
    return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def map_rows(fn: Callable[[Any], Any], tree: Any, n: int) -> Any:
    """fn over n strided row slices of tree, one after the other (bounded memory), outputs merged."""
    if n == 1:
        return fn(tree)
    out = jax.lax.map(fn, jax.tree.map(lambda x: split_rows(x, n), tree))
    return jax.tree.map(merge_rows, out)


def scan_or_call(body: Callable[[Any, Any], tuple[Any, Any]], carry: Any, xs: Any, length: int) -> tuple[Any, Any]:
    """lax.scan, but a single iteration is a plain call: XLA optimises a loop body less well."""
    if length > 1:
        return jax.lax.scan(body, carry, xs, length=length)
    carry, out = body(carry, jax.tree.map(lambda x: x[0], xs))
    return carry, jax.tree.map(lambda y: y[None], out)


# Loss terms already divided by the whole mini-batch's normalizer: their micro-batch values add up.
ADDITIVE_METRICS = ("loss", "total_loss", "entropy", "kl_loss", "loss_sum", "token_count", "distill_loss",
                    "reward_loss")


def weighted_metrics(per_micro: dict[str, jax.Array], counts: jax.Array) -> dict[str, jax.Array]:
    """Combine micro-batch metrics as one batch would: sums add, maxima max, means by tokens."""
    total = jnp.maximum(jnp.sum(counts), 1.0)
    out = {}
    for name, values in per_micro.items():
        if name in ADDITIVE_METRICS:
            out[name] = jnp.sum(values)
        elif name.endswith("_max"):
            out[name] = jnp.max(values)
        else:
            out[name] = jnp.sum(values * counts) / total
    return out


def accumulate_grads(loss_fn: Callable[[Any, Any], tuple[jax.Array, dict[str, jax.Array]]], params: Any,
                     targets: Any, microbatches: int, mask: Callable[[Any], jax.Array]
                     ) -> tuple[Any, dict[str, jax.Array]]:
    """Σ over `microbatches` strided slices of `targets` of grad(loss_fn)(params, slice), and the
    slices' metrics combined by `weighted_metrics` (token counts from `mask(slice)`, [rows, T]).
    loss_fn must already divide by the whole batch's normalizer, so the sum is the batch gradient."""
    grad_fn = jax.grad(loss_fn, has_aux=True)
    if microbatches == 1:
        return grad_fn(params, targets)

    def body(grad_sum, one):
        grads, metrics = grad_fn(params, one)
        return jax.tree.map(jnp.add, grad_sum, grads), metrics

    micro = jax.tree.map(lambda x: split_rows(x, microbatches), targets)
    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, metrics = jax.lax.scan(body, zeros, micro)
    counts = jnp.sum(mask(micro), axis=(1, 2))
    return grads, weighted_metrics(metrics, counts)


def apply_update(tx: optax.GradientTransformation, params: Any, opt_state: Any, grads: Any
                 ) -> tuple[Any, Any, dict[str, jax.Array]]:
    """One optimizer update, skipped (params and optimizer state kept) when any gradient is NaN/inf."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm)
    updates, new_opt = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
    return keep(new_params, params), keep(new_opt, opt_state), {
        "grad_norm": grad_norm, "skipped_nonfinite": 1.0 - finite.astype(jnp.float32)}
