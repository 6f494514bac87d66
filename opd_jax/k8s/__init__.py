"""Running on a Kubernetes cluster: JobSet + Kueue (+ LeaderWorkerSet for SGLang servers)
manifests rendered from a config, checked against their kinds' schemas, and the entrypoint of the
pods they start. No cluster is contacted: `kubectl apply` is the user's."""

from opd_jax.k8s.pod import run_in_pod
from opd_jax.k8s.render import KINDS, detect_kind, dump_manifests, render
from opd_jax.k8s.spec import ClusterSpec, K8sError, Toleration, parse_pairs
from opd_jax.k8s.validate import validate_manifests

__all__ = ["KINDS", "ClusterSpec", "K8sError", "Toleration", "detect_kind", "dump_manifests", "parse_pairs", "render",
           "run_in_pod", "validate_manifests"]
