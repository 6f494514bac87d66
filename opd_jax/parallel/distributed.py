"""Multi-host start-up: jax.distributed from a config, the environment, or the cluster (SLURM,
TPU pods, ...), plus turning each process's rows of a batch into one global array."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Unset fields fall back to OPD_JAX_COORDINATOR / OPD_JAX_NUM_PROCESSES / OPD_JAX_PROCESS_ID
    / OPD_JAX_LOCAL_DEVICE_IDS, then to JAX's own detection (JAX_COORDINATOR_ADDRESS, SLURM, ...).
    `enabled=False` (the default) runs as a single process."""

    __pydantic_config__ = {"use_attribute_docstrings": True, "extra": "forbid"}  # as the config sections

    enabled: bool = False
    """Start jax.distributed (multi-host); false: a single process."""
    coordinator_address: str | None = None
    """host:port of process 0; unset: OPD_JAX_COORDINATOR, then JAX's detection."""
    num_processes: int | None = None
    """Number of processes; unset: OPD_JAX_NUM_PROCESSES, then JAX's detection."""
    process_id: int | None = None
    """This process's index; unset: OPD_JAX_PROCESS_ID, then JAX's detection."""
    local_device_ids: tuple[int, ...] | None = None
    """Devices this process uses; unset: OPD_JAX_LOCAL_DEVICE_IDS, then all local ones."""
    initialization_timeout_s: int = 300
    """How long to wait for every process to join."""


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def initialize_distributed(config: DistributedConfig) -> bool:
    """Join the multi-process job described by `config` (idempotent); returns whether this is a
    multi-process run. Call it before anything touches jax.devices()."""
    if not config.enabled:
        return False
    if jax.distributed.is_initialized():
        return True
    ids: Sequence[int] | None = config.local_device_ids
    if ids is None and os.environ.get("OPD_JAX_LOCAL_DEVICE_IDS"):
        ids = [int(i) for i in os.environ["OPD_JAX_LOCAL_DEVICE_IDS"].split(",")]
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address or os.environ.get("OPD_JAX_COORDINATOR"),
        num_processes=config.num_processes if config.num_processes is not None else _env_int("OPD_JAX_NUM_PROCESSES"),
        process_id=config.process_id if config.process_id is not None else _env_int("OPD_JAX_PROCESS_ID"),
        local_device_ids=ids, initialization_timeout=config.initialization_timeout_s)
    return True


def global_batch(local: Any, shardings: Any) -> Any:
    """One global jax.Array per leaf from each process's own consecutive rows of the batch
    (process p holds rows p·n .. (p+1)·n − 1 of the global batch)."""
    return jax.tree.map(lambda x, s: jax.make_array_from_process_local_data(s, np.asarray(x)), local, shardings)
