"""What a cluster run needs beyond the config: the image, the Kueue queue, hosts and accelerators,
placement, resources and the run directory's volume. Every field is checked here, so a bad flag is
one line naming it before anything is rendered."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from opd_jax.errors import OpdJaxError


class K8sError(OpdJaxError, ValueError):
    """A cluster setting or a config that cannot be rendered (or a manifest that does not validate)."""


# RFC 1123 label: what Kubernetes requires of object names used as hostnames and of Kueue's
# queue names (a LocalQueue is referenced by the `kueue.x-k8s.io/queue-name` label's value)
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# a resource quantity: 500m, 2, 1.5, 64Gi, 1e3 ...
_QUANTITY = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+|[KMGTPE]i?|[mkMGTPE])?$")
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
MAX_NAME = 40  # room for JobSet's "-<replicated job>-<job>-<pod>" and the Job's pod suffix within 63


def check_label(value: str, flag: str, max_len: int = 63) -> str:
    if len(value) > max_len or not _LABEL.match(value):
        raise K8sError(f"{flag} {value!r} is not a valid Kubernetes name: lowercase letters, digits and '-', "
                       f"starting and ending with a letter or digit, at most {max_len} characters")
    return value


def to_label(text: str) -> str:
    """A name as an RFC 1123 label: lowercase, every other character a '-' (copy_edit → copy-edit)."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-")


@dataclasses.dataclass(frozen=True)
class Toleration:
    key: str
    value: str | None
    effect: str | None

    @classmethod
    def parse(cls, text: str) -> Toleration:
        """key[=value][:Effect]"""
        rest, _, effect = text.partition(":")
        key, _, value = rest.partition("=")
        if not key or (effect and effect not in _EFFECTS):
            raise K8sError(f"--toleration {text!r}: expected key[=value][:Effect], Effect one of {', '.join(_EFFECTS)}")
        return cls(key, value or None, effect or None)

    def manifest(self) -> dict:
        out = {"key": self.key, "operator": "Equal" if self.value else "Exists"}
        if self.value:
            out["value"] = self.value
        if self.effect:
            out["effect"] = self.effect
        return out


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """One cluster run's settings (the flags of `opd-jax k8s render`)."""

    image: str
    """The opd_jax image (trainer, merge, experts)."""
    queue: str
    """Kueue LocalQueue the workloads are submitted to."""
    name: str
    """Prefix of every object's name."""
    namespace: str = "default"
    priority_class: str | None = None
    """Kueue WorkloadPriorityClass."""
    hosts: int = 1
    """Pods (jax.distributed processes) of the training job, and of each expert."""
    accelerators: int = 0
    """Accelerators per pod (0: CPU only)."""
    accelerator_resource: str = "nvidia.com/gpu"
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Toleration, ...] = ()
    cpu: str | None = None
    memory: str | None = None
    volume_claim: str = "opd-jax-runs"
    """A ReadWriteMany PersistentVolumeClaim (NFS, Filestore, a GCS/S3 FUSE CSI volume, ...)."""
    mount_path: str = "/workspace"
    """Where it is mounted; every pod's working directory, so the config's relative paths land on it."""
    max_restarts: int = 3
    env: tuple[tuple[str, str], ...] = ()
    """Environment variables of the opd_jax containers (HF_TOKEN, XLA_FLAGS, ...)."""
    service_account: str | None = None
    """Every pod's Kubernetes service account (a bucket's workload identity, ...)."""
    image_pull_secrets: tuple[str, ...] = ()
    server_image: str | None = None
    """The SGLang servers' image (an SGLang engine or SGLang teachers need one)."""
    server_hosts: int = 1
    server_accelerators: int | None = None
    router: bool = True
    router_image: str | None = None

    def __post_init__(self) -> None:
        if not self.image:
            raise K8sError("--image is required: the opd_jax image the pods run")
        check_label(self.queue, "--queue")
        check_label(self.name, "--name", MAX_NAME)
        check_label(self.namespace, "--namespace")
        if self.priority_class is not None:
            check_label(self.priority_class, "--priority")
        for flag, value in (("--hosts", self.hosts), ("--server-hosts", self.server_hosts)):
            if value < 1:
                raise K8sError(f"{flag} {value}: needs at least one pod")
        for flag, value in (("--accelerators", self.accelerators), ("--server-accelerators", self.server_accelerators),
                            ("--max-restarts", self.max_restarts)):
            if value is not None and value < 0:
                raise K8sError(f"{flag} {value}: cannot be negative")
        for flag, value in (("--cpu", self.cpu), ("--memory", self.memory)):
            if value is not None and not _QUANTITY.match(value):
                raise K8sError(f"{flag} {value!r} is not a Kubernetes quantity (e.g. 8, 500m, 64Gi)")
        check_label(self.volume_claim, "--volume-claim")
        for secret in self.image_pull_secrets:
            check_label(secret, "--image-pull-secret", 253)
        if self.service_account is not None:
            check_label(self.service_account, "--service-account", 253)
        for key, _ in self.env:
            if not re.match(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", key):
                raise K8sError(f"--env {key!r}: not a valid environment variable name")
        if not self.mount_path.startswith("/"):
            raise K8sError(f"--mount-path {self.mount_path!r} must be an absolute path")

    @property
    def devices(self) -> int:
        """jax devices of the training job: each pod's accelerators (a CPU pod: one device)."""
        return self.hosts * max(self.accelerators, 1)


def parse_pairs(items: Sequence[str], flag: str) -> tuple[tuple[str, str], ...]:
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise K8sError(f"{flag} {item!r}: expected key=value")
        out.append((key, value))
    return tuple(out)
