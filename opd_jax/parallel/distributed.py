"""Multi-host start-up: jax.distributed from a config, the environment, a JobSet pod's
environment (`enabled: auto`), or JAX's own cluster detection (SLURM, TPU pods, ...), plus turning
each process's rows of a batch into one global array."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax
import numpy as np

from opd_jax.errors import OpdJaxError


class DistributedError(OpdJaxError, ValueError):
    """An environment that does not describe this process's place in the job."""


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Unset fields fall back to OPD_JAX_COORDINATOR / OPD_JAX_NUM_PROCESSES / OPD_JAX_PROCESS_ID
    / OPD_JAX_LOCAL_DEVICE_IDS, then (enabled 'auto') to a JobSet pod's environment, then to
    JAX's own detection (JAX_COORDINATOR_ADDRESS, SLURM, ...). `enabled=False` (the default) runs
    as a single process."""

    __pydantic_config__ = {"use_attribute_docstrings": True, "extra": "forbid"}  # as the config sections

    enabled: bool | Literal["auto"] = False
    """Start jax.distributed (multi-host); false: a single process; auto: as a JobSet pod's environment says (one process outside a JobSet, or in a JobSet of one pod)."""  # noqa: E501
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


def _env_int(name: str, env: Mapping[str, str]) -> int | None:
    value = env.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"environment variable {name}={value!r} is not an integer") from None


# What a JobSet pod knows about its place (JobSet's annotations through the downward API, as
# `opd-jax k8s render` writes them, and the Indexed Job's own JOB_COMPLETION_INDEX); the hostname
# rule is JobSet's: <jobset>-<replicated job>-<job index>-<pod index>.<subdomain>.
JOBSET_ENV = ("JOBSET_NAME", "REPLICATED_JOB_NAME", "REPLICATED_JOB_REPLICAS", "JOB_INDEX", "JOB_COMPLETION_INDEX")
COORDINATOR_PORT = 8476  # JAX's own choice for the pods of a TPU slice


@dataclasses.dataclass(frozen=True)
class JobSetPlace:
    """This process's place in a JobSet: the coordinator (process 0's pod) and its index."""

    coordinator_address: str
    num_processes: int
    process_id: int


def jobset_place(env: Mapping[str, str]) -> JobSetPlace | None:
    """From a JobSet pod's environment: JOBSET_NAME, REPLICATED_JOB_NAME, REPLICATED_JOB_REPLICAS,
    JOB_INDEX, JOB_COMPLETION_INDEX, and optionally OPD_JAX_HOSTS_PER_JOB (the pods of each job,
    default 1), JOBSET_COORDINATOR (JobSet's coordinator annotation, its pod's stable hostname)
    and OPD_JAX_COORDINATOR_PORT:

        process_id    = JOB_INDEX × hosts_per_job + JOB_COMPLETION_INDEX
        num_processes = REPLICATED_JOB_REPLICAS × hosts_per_job
        coordinator   = JOBSET_COORDINATOR, else JOBSET_NAME-REPLICATED_JOB_NAME-0-0.JOBSET_NAME
                        (JobSet's pod hostname rule, the JobSet's name its default subdomain)

    None outside a JobSet (JOBSET_NAME unset)."""
    if not env.get("JOBSET_NAME"):
        return None
    missing = [name for name in JOBSET_ENV if env.get(name) in (None, "")]
    if missing:
        raise DistributedError(f"distributed auto: a JobSet pod (JOBSET_NAME={env['JOBSET_NAME']}) without "
                               f"{', '.join(missing)} in its environment; render its manifest with "
                               f"`opd-jax k8s render`")
    read = {name: _env_int(name, env) for name in (*JOBSET_ENV[2:], "OPD_JAX_HOSTS_PER_JOB", "OPD_JAX_COORDINATOR_PORT")}
    hosts = read["OPD_JAX_HOSTS_PER_JOB"] or 1
    host = env.get("JOBSET_COORDINATOR") or f"{env['JOBSET_NAME']}-{env['REPLICATED_JOB_NAME']}-0-0.{env['JOBSET_NAME']}"
    return JobSetPlace(f"{host}:{read['OPD_JAX_COORDINATOR_PORT'] or COORDINATOR_PORT}",
                       read["REPLICATED_JOB_REPLICAS"] * hosts, read["JOB_INDEX"] * hosts + read["JOB_COMPLETION_INDEX"])


def initialize_distributed(config: DistributedConfig, env: Mapping[str, str] | None = None) -> bool:
    """Join the multi-process job described by `config` (idempotent); returns whether this is a
    multi-process run. Call it before anything touches jax.devices(). Each setting: the config's,
    else OPD_JAX_*, else (enabled 'auto') the JobSet pod's, else JAX's detection."""
    env = os.environ if env is None else env
    if not config.enabled:
        return False
    place = jobset_place(env) if config.enabled == "auto" else None
    explicit = (config.coordinator_address, config.num_processes, config.process_id)
    if config.enabled == "auto" and place is None and all(v is None for v in explicit) \
            and not env.get("OPD_JAX_COORDINATOR"):
        return False  # not in a JobSet and nothing says otherwise: one process
    if jax.distributed.is_initialized():
        return True
    num = config.num_processes if config.num_processes is not None else _env_int("OPD_JAX_NUM_PROCESSES", env)
    if num is None and place is not None:
        num = place.num_processes
    if num == 1 and config.enabled == "auto":
        return False  # a JobSet of one pod
    process_id = config.process_id if config.process_id is not None else _env_int("OPD_JAX_PROCESS_ID", env)
    ids: Sequence[int] | None = config.local_device_ids
    if ids is None and env.get("OPD_JAX_LOCAL_DEVICE_IDS"):
        ids = [int(i) for i in env["OPD_JAX_LOCAL_DEVICE_IDS"].split(",")]
    jax.distributed.initialize(
        coordinator_address=(config.coordinator_address or env.get("OPD_JAX_COORDINATOR")
                             or (place.coordinator_address if place else None)),
        num_processes=num,
        process_id=process_id if process_id is not None or place is None else place.process_id,
        local_device_ids=ids, initialization_timeout=config.initialization_timeout_s)
    return True


def global_batch(local: Any, shardings: Any) -> Any:
    """One global jax.Array per leaf from each process's own consecutive rows of the batch
    (process p holds rows p·n .. (p+1)·n − 1 of the global batch)."""
    return jax.tree.map(lambda x, s: jax.make_array_from_process_local_data(s, np.asarray(x)), local, shardings)
