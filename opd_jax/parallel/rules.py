"""Logical-axis sharding: the one table that maps the names on parameters and activations onto
mesh axes, and the NamedShardings it gives for parameters, optimizer state and batches.

Parameters carry `logical_axes` metadata (see opd_jax.models.decoder) and batches the "batch"
axis; XLA propagates the rest through the activations. (A constraint on the residual stream made
XLA's SPMD partitioner rematerialise the embedding gradient, so activations are left to it.) A
dimension whose size the mesh axes do not divide (9 heads over tensor=2, say) is replicated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from opd_jax.parallel.mesh import MeshError

LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]

# FSDP shards the model dimension of every weight (ZeRO-3); tensor parallelism splits heads,
# MLP width and vocabulary (Megatron); batches split over both data-parallel axes. Expert
# parallelism puts each data-parallel group's share of a MoE layer's experts on it (GShard,
# DeepSpeed-MoE: experts over the data axis), so a mesh with data=d holds E/d experts per device
# along that axis, FSDP and tensor parallelism still splitting each expert's matrices. Context
# parallelism splits a training forward's tokens ("length": the residual stream, each device's
# queries) over the sequence axis; the attention all-gathers keys and values (models.attention).
DEFAULT_RULES: LogicalRules = (
    ("batch", ("data", "fsdp")),
    ("length", "sequence"),
    ("expert", "data"),
    ("expert_scores", None),  # the router's output dimension (small; replicated)
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("layers", None),
    ("head_dim", None),
    ("q_lora", None),  # MLA's low-rank query and compressed key/value widths: the latents every head reads
    ("kv_lora", None),
    ("index_heads", "tensor"),  # DSA's indexer heads, split as attention heads are
    ("index_dim", None),
    ("norm", None),
    ("lora_rank", None),  # a LoRA adapter's inner dimension (small; its other axis is sharded as the weight's)
    ("lora_adapter", None),  # the adapters of a bank (LoRA teachers on one base; each is small)
)


def _axis_size(mesh: Mesh, axes: str | tuple[str, ...] | None) -> int:
    if axes is None:
        return 1
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def logical_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                 rules: LogicalRules = DEFAULT_RULES) -> PartitionSpec:
    """PartitionSpec for an array of `shape` whose dimensions are called `names`; a dimension the
    mapped mesh axes do not divide evenly is left unsharded."""
    if len(names) != len(shape):
        raise ValueError(f"logical axes {tuple(names)} do not match an array of shape {tuple(shape)}")
    spec = nn.logical_to_mesh_axes(tuple(names), rules)
    return PartitionSpec(*(axes if size % _axis_size(mesh, axes) == 0 else None
                           for axes, size in zip(spec, shape)))


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def tree_shardings(tree: Any, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES) -> Any:
    """NamedShardings for a pytree holding nnx Variables (parameters, or optimizer moments, which
    optax builds as copies of them and so keep their logical axes) and plain arrays, which are
    replicated, as are weights held quantized. The result is a prefix tree of `tree`, fit for
    jax.jit's in/out_shardings."""
    def one(x):
        if _is_variable(x):
            names = x.get_metadata().get("logical_axes")
            # a weight held quantized (a QLoRA base: values and scales, not one array) is replicated
            value = x.get_value()
            if names is not None and hasattr(value, "dtype"):  # an array, tracer or shape (not values + scales)
                return NamedSharding(mesh, logical_spec(names, value.shape, mesh, rules))
        return NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(one, tree, is_leaf=_is_variable)


def batch_shards(mesh: Mesh, rules: LogicalRules = DEFAULT_RULES) -> int:
    """How many ways a batch's rows are split on `mesh` (the mesh axes the "batch" axis maps to)."""
    return _axis_size(mesh, nn.logical_to_mesh_axes(("batch",), rules)[0])


def batch_shardings(batch: Any, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES) -> Any:
    """Every array of `batch` split along its first (sample) dimension over the "batch" axes."""
    axes = nn.logical_to_mesh_axes(("batch",), rules)[0]
    split = _axis_size(mesh, axes)

    def one(x):
        if x.shape[0] % split:
            raise MeshError(f"a batch of {x.shape[0]} samples does not split over {split} data-parallel "
                             f"shards (mesh axes {axes}); use a multiple of {split}")
        return NamedSharding(mesh, PartitionSpec(axes, *([None] * (x.ndim - 1))))
    return jax.tree.map(one, batch)


def shard(tree: Any, shardings: Any) -> Any:
    """Place `tree` (host or device arrays, identical on every process) by `shardings` (a prefix
    tree, as from tree_shardings). Works across processes: each one fills its own shards."""
    def place(x, sharding):
        host = jax.device_get(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jax.tree.map(lambda s, x: jax.tree.map(lambda leaf: place(leaf, s), x), shardings, tree,
                        is_leaf=lambda s: isinstance(s, NamedSharding))
