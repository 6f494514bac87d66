"""Sharding over a device mesh: mesh construction, logical-axis rules, the sharded jit, multi-host."""

from opd_jax.parallel.compile import compile_abstract, scoring_jit, sharded_scoring, sharded_step, step_jit, under_mesh
from opd_jax.parallel.distributed import (
    DistributedConfig,
    DistributedError,
    JobSetPlace,
    global_batch,
    initialize_distributed,
    jobset_place,
)
from opd_jax.parallel.mesh import MESH_AXES, MeshConfig, MeshError, make_mesh
from opd_jax.parallel.rules import (
    DEFAULT_RULES,
    LogicalRules,
    batch_shardings,
    batch_shards,
    logical_spec,
    shard,
    tree_shardings,
)

__all__ = ["DEFAULT_RULES", "MESH_AXES", "DistributedConfig", "DistributedError", "JobSetPlace", "LogicalRules",
           "MeshConfig", "MeshError", "batch_shardings", "batch_shards", "compile_abstract", "global_batch",
           "initialize_distributed", "jobset_place", "logical_spec", "make_mesh", "scoring_jit", "shard",
           "sharded_scoring", "sharded_step", "step_jit", "tree_shardings", "under_mesh"]
