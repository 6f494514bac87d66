"""The device mesh, from a config: named axes data / fsdp / sequence / tensor, one size per axis, -1 = the rest."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from opd_jax.errors import OpdJaxError

MESH_AXES = ("data", "fsdp", "sequence", "tensor")


class MeshError(OpdJaxError, ValueError):
    """A mesh shape that does not fit the devices."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the data-parallel, fully-sharded-data-parallel, context-parallel and tensor-parallel axes. At most
    one may be -1, meaning all devices left over; their product must equal the device count."""

    __pydantic_config__ = {"use_attribute_docstrings": True, "extra": "forbid"}  # as the config sections

    data: int = -1
    """Data-parallel axis size (-1: the devices left over)."""
    fsdp: int = 1
    """Fully-sharded data-parallel axis size: parameters and optimizer state sharded, batches split."""
    sequence: int = 1
    """Context-parallel axis size: each sequence's tokens split, attention over all-gathered keys and values
    (docs/long_sequences.md)."""
    tensor: int = 1
    """Tensor-parallel axis size: heads, MLP width and vocabulary split."""

    def __post_init__(self):
        sizes = [self.data, self.fsdp, self.sequence, self.tensor]
        if any(not isinstance(s, int) or s == 0 or s < -1 for s in sizes):
            raise MeshError(f"mesh axis sizes must be positive or -1, got {self.describe(sizes)}")
        if sizes.count(-1) > 1:
            raise MeshError(f"only one mesh axis may be -1, got {self.describe(sizes)}")

    def shape(self, num_devices: int) -> tuple[int, ...]:
        sizes = [self.data, self.fsdp, self.sequence, self.tensor]
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise MeshError(f"mesh {self.describe(sizes)} does not divide {num_devices} devices: "
                                f"{num_devices} is not a multiple of {known}")
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) != num_devices:
            raise MeshError(f"mesh {self.describe(sizes)} needs {math.prod(sizes)} devices but "
                            f"{num_devices} are available")
        return tuple(sizes)

    @staticmethod
    def describe(sizes: Sequence[int]) -> str:
        return "(" + ", ".join(f"{name}={size}" for name, size in zip(MESH_AXES, sizes)) + ")"


def make_mesh(config: MeshConfig = MeshConfig(), devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A Mesh over `devices` (default: every device of every process) with axes MESH_AXES.
    jax.make_mesh orders the devices so the inner axes (tensor, then sequence, then fsdp) get the
    fastest links."""
    devices = list(jax.devices() if devices is None else devices)
    shape = config.shape(len(devices))
    # Auto axes: XLA propagates shardings from the jit's in/out shardings and the logical
    # constraints (JAX's default for make_mesh is now Explicit, which types every array).
    auto = (AxisType.Auto,) * len(MESH_AXES)
    if len(devices) == len(jax.devices()):
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)
