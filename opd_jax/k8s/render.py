"""Kubernetes manifests for the run a config describes.

    train / merge   one JobSet of `hosts` pods (one Indexed Job; JobSet's DNS hostnames; the
                    coordinator is pod 0), queued by Kueue; every pod runs `opd-jax k8s run`,
                    which finds its place from the JobSet's environment (`distributed: auto`)
    experts         one JobSet for the base and one per expert, so Kueue admits each on its own
                    and a failed expert is retried alone (JobSet restarts); an expert's pods wait
                    for the base's base.json on the shared volume before they start
    SGLang          a LeaderWorkerSet per server group (the policy's rollout servers; each SGLang
                    teacher's) with a Service over its leaders, booted on a model on the shared
                    volume, and an sglang-router
                    Deployment + Service in front of the rollout servers. The trainer talks to each
                    server by its stable leader hostname, so it refits each one and checks the
                    weight version each reports (a router would hide which server answered)
    ConfigMap       the resolved config the pods run, rewritten for the cluster: multi-host start
                    from the JobSet (`distributed: auto`), running servers instead of launched ones

The run directory is a ReadWriteMany volume mounted as every pod's working directory, so the
config's relative paths (run_dir, experts_dir, checkpoints, refit weights) land on it, and the
servers read the trainer's refit weights from the same paths."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import PurePosixPath
from typing import Any

import yaml
from pydantic import BaseModel

from opd_jax.config import ConfigError, ExpertsConfig, MergeConfig, TrainConfig, dump_config, to_plain
from opd_jax.config.commands import command_of, command_schemas
from opd_jax.k8s.spec import ClusterSpec, K8sError, check_label, to_label
from opd_jax.parallel import MeshError
from opd_jax.parallel.distributed import COORDINATOR_PORT

CONFIG_DIR = "/etc/opd-jax"
CONFIG_PATH = f"{CONFIG_DIR}/config.yaml"
SERVER_PORT = 30000
MAX_JOBSET_NAME = 50  # its pods' hostnames, <jobset>-workers-<job>-<pod>, stay within 63
WAIT_FOR_SERVERS_S = 1800.0  # cluster servers pull their image and load their model beside the trainer
KINDS = command_schemas(on_cluster=True)
Manifest = dict[str, Any]


def detect_kind(data: dict[str, Any], source: str = "this config") -> str:
    """Which command a config (its top-level keys, read from `source`) is for; a recipe has no
    cluster form."""
    command = command_of(set(data))
    if not command.on_cluster:
        raise K8sError(f"{source} is a {command.name} config (one process, every phase); on a cluster render its "
                       f"parts: an experts config, then a merge config (docs/cluster.md)")
    return command.name


# ---------------------------------------------------------------------------------- the pieces


def _labels(spec: ClusterSpec, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "opd-jax", "app.kubernetes.io/instance": spec.name,
            "app.kubernetes.io/component": component}


def _queued(spec: ClusterSpec, component: str) -> dict[str, str]:
    labels = {**_labels(spec, component), "kueue.x-k8s.io/queue-name": spec.queue}
    if spec.priority_class:
        labels["kueue.x-k8s.io/priority-class"] = spec.priority_class
    return labels


def _meta(name: str, spec: ClusterSpec, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": spec.namespace, "labels": labels}


def _resources(spec: ClusterSpec, accelerators: int) -> dict[str, Any]:
    requests: dict[str, Any] = {}
    if spec.cpu:
        requests["cpu"] = spec.cpu
    if spec.memory:
        requests["memory"] = spec.memory
    limits = {spec.accelerator_resource: accelerators} if accelerators else {}
    if spec.memory:
        limits["memory"] = spec.memory
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def _volumes(spec: ClusterSpec, with_config: bool = True) -> list[dict[str, Any]]:
    volumes = [{"name": "runs", "persistentVolumeClaim": {"claimName": spec.volume_claim}}]
    if with_config:
        volumes.append({"name": "config", "configMap": {"name": f"{spec.name}-config"}})
    return volumes


def _mounts(spec: ClusterSpec, with_config: bool = True) -> list[dict[str, Any]]:
    mounts = [{"name": "runs", "mountPath": spec.mount_path}]
    if with_config:
        mounts.append({"name": "config", "mountPath": CONFIG_DIR, "readOnly": True})
    return mounts


def _pod_access(spec: ClusterSpec) -> dict[str, Any]:
    """Who every pod runs as and how it pulls its image."""
    out: dict[str, Any] = {}
    if spec.service_account:
        out["serviceAccountName"] = spec.service_account
    if spec.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    return out


def _placement(spec: ClusterSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if spec.node_selector:
        out["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        out["tolerations"] = [t.manifest() for t in spec.tolerations]
    return out


def _annotation(key: str) -> dict[str, Any]:
    return {"fieldRef": {"fieldPath": f"metadata.annotations['{key}']"}}


def _jobset_env(hosts: int) -> list[dict[str, Any]]:
    """What opd_jax.parallel.jobset_place reads: JobSet's annotations through the downward API
    (JOB_COMPLETION_INDEX is the Indexed Job's own)."""
    return [{"name": "JOBSET_NAME", "valueFrom": _annotation("jobset.sigs.k8s.io/jobset-name")},
            {"name": "REPLICATED_JOB_NAME", "valueFrom": _annotation("jobset.sigs.k8s.io/replicatedjob-name")},
            {"name": "REPLICATED_JOB_REPLICAS", "valueFrom": _annotation("jobset.sigs.k8s.io/replicatedjob-replicas")},
            {"name": "JOB_INDEX", "valueFrom": _annotation("jobset.sigs.k8s.io/job-index")},
            {"name": "JOBSET_COORDINATOR", "valueFrom": _annotation("jobset.sigs.k8s.io/coordinator")},
            {"name": "OPD_JAX_HOSTS_PER_JOB", "value": str(hosts)},
            {"name": "OPD_JAX_COORDINATOR_PORT", "value": str(COORDINATOR_PORT)},
            {"name": "PYTHONUNBUFFERED", "value": "1"}]


def _wait_for(path: str, spec: ClusterSpec, image: str) -> dict[str, Any]:
    """An init container that holds the pod until `path` exists on the shared volume."""
    script = f"until [ -e {shlex.quote(path)} ]; do echo waiting for {shlex.quote(path)}; sleep 15; done"
    return {"name": "wait", "image": image, "workingDir": spec.mount_path, "command": ["sh", "-c", script],
            "volumeMounts": _mounts(spec, with_config=False)}


def jobset(name: str, spec: ClusterSpec, args: list[str], *, hosts: int, component: str,
           wait_for: str | None = None) -> Manifest:
    """A JobSet of `hosts` pods running `opd-jax k8s run ARGS`. Exit status 2 (a problem the user
    must fix: config, data, checkpoint) fails the JobSet at once; any other failure of any pod
    restarts all of them together (jax.distributed cannot lose one process), at most
    max_restarts times, and `opd-jax k8s run` resumes from the last checkpoint."""
    if len(name) > MAX_JOBSET_NAME:
        raise K8sError(f"JobSet name {name!r} is longer than {MAX_JOBSET_NAME} characters (its pods' hostnames must "
                       f"fit in 63): choose a shorter --name")
    container = {"name": "opd-jax", "image": spec.image, "workingDir": spec.mount_path,
                 "command": ["opd-jax", "k8s", "run", *args],
                 "env": [*_jobset_env(hosts), *({"name": k, "value": v} for k, v in spec.env)],
                 "ports": [{"name": "coordinator", "containerPort": COORDINATOR_PORT}],
                 "volumeMounts": _mounts(spec)}
    resources = _resources(spec, spec.accelerators)
    if resources:
        container["resources"] = resources
    pod: dict[str, Any] = {"restartPolicy": "Never", "containers": [container], "volumes": _volumes(spec),
                           **_pod_access(spec), **_placement(spec)}
    if wait_for is not None:
        pod["initContainers"] = [_wait_for(wait_for, spec, spec.image)]
    job = {"parallelism": hosts, "completions": hosts, "completionMode": "Indexed", "backoffLimit": 0,
           "podFailurePolicy": {"rules": [{"action": "FailJob",
                                           "onExitCodes": {"containerName": "opd-jax", "operator": "In",
                                                           "values": [2]}}]},
           "template": {"metadata": {"labels": _labels(spec, component)}, "spec": pod}}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": _meta(name, spec, _queued(spec, component)),
            "spec": {"failurePolicy": {"maxRestarts": spec.max_restarts, "restartStrategy": "Recreate",
                                       "rules": [{"name": "user-error", "action": "FailJobSet",
                                                  "onJobFailureReasons": ["PodFailurePolicy"]}]},
                     "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                     "coordinator": {"replicatedJob": "workers", "jobIndex": 0, "podIndex": 0},
                     "replicatedJobs": [{"name": "workers", "replicas": 1, "template": {"spec": job}}]}}


def config_map(spec: ClusterSpec, config: BaseModel) -> Manifest:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(f"{spec.name}-config", spec, _labels(spec, "config")),
            "data": {"config.yaml": dump_config(config)}}


def server_urls(name: str, replicas: int) -> list[str]:
    """Each server's leader pod by its stable hostname (LeaderWorkerSet: <lws>-<i>.<lws>)."""
    return [f"http://{name}-{i}.{name}:{SERVER_PORT}" for i in range(replicas)]


def server_group(name: str, spec: ClusterSpec, launch: Any, model_path: str, flags: tuple[str, ...] = (),
                 *, wait: bool) -> list[Manifest]:
    """A LeaderWorkerSet of launch.num_servers SGLang servers of spec.server_hosts pods each,
    running the config's launch command (its program from the server image's PATH) on
    `model_path`, and a Service over their leaders (any one server, for whoever needs one);
    `wait`: they start once the model is on the volume (the trainer writes it)."""
    if not spec.server_image:
        raise K8sError("--server-image is required: the config runs SGLang servers (the image of their launch command)")
    check_label(name, "server group name", MAX_JOBSET_NAME)
    command = [PurePosixPath(launch.command[0]).name, *launch.command[1:], *flags]
    argv = shlex.join(part.format(model_path=model_path, host="0.0.0.0", port=SERVER_PORT) for part in command)
    if spec.server_hosts > 1:  # SGLang's multi-node flags from LeaderWorkerSet's environment
        argv += ' --nnodes "$LWS_GROUP_SIZE" --node-rank "$LWS_WORKER_INDEX" --dist-init-addr "$LWS_LEADER_ADDRESS:20000"'
    script = f"exec {argv}"
    if wait:
        ready = shlex.quote(f"{model_path}/config.json")
        script = f"until [ -e {ready} ]; do echo waiting for {ready}; sleep 15; done; {script}"
    accelerators = spec.accelerators if spec.server_accelerators is None else spec.server_accelerators
    container = {"name": "sglang", "image": spec.server_image, "workingDir": spec.mount_path,
                 "command": ["sh", "-c", script], "env": [{"name": k, "value": v} for k, v in launch.env.items()],
                 "ports": [{"name": "http", "containerPort": SERVER_PORT}],
                 "readinessProbe": {"httpGet": {"path": "/health", "port": SERVER_PORT}, "periodSeconds": 10},
                 "volumeMounts": [*_mounts(spec, with_config=False), {"name": "shm", "mountPath": "/dev/shm"}]}
    resources = _resources(spec, accelerators)
    if resources:
        container["resources"] = resources
    # SGLang's processes share tensors through /dev/shm, which a container gets only 64 MiB of
    volumes = [*_volumes(spec, with_config=False), {"name": "shm", "emptyDir": {"medium": "Memory"}}]
    template = {"metadata": {"labels": _labels(spec, name)},
                "spec": {"containers": [container], "volumes": volumes, **_pod_access(spec), **_placement(spec)}}
    group = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
             "metadata": _meta(name, spec, _queued(spec, "sglang")),
             "spec": {"replicas": launch.num_servers,
                      "leaderWorkerTemplate": {"size": spec.server_hosts, "restartPolicy": "RecreateGroupOnPodRestart",
                                               "workerTemplate": template}}}
    # LeaderWorkerSet's own labels on its pods; worker 0 of each group is its leader (the server)
    leaders = {"leaderworkerset.sigs.k8s.io/name": name, "leaderworkerset.sigs.k8s.io/worker-index": "0"}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(f"{name}-leaders", spec, _labels(spec, name)),
               "spec": {"selector": leaders, "ports": [{"name": "http", "port": SERVER_PORT, "targetPort": "http"}]}}
    return [group, service]


def router(spec: ClusterSpec, urls: list[str]) -> list[Manifest]:
    """sglang-router in front of the rollout servers (cache-aware load balancing for anything
    else that samples from them: evaluations, a person's requests), and its Service."""
    name = f"{spec.name}-router"
    labels = _labels(spec, "router")
    container = {"name": "router", "image": spec.router_image or spec.server_image,
                 "command": ["python3", "-m", "sglang_router.launch_router", "--worker-urls", *urls,
                             "--host", "0.0.0.0", "--port", str(SERVER_PORT)],
                 "ports": [{"name": "http", "containerPort": SERVER_PORT}],
                 "readinessProbe": {"httpGet": {"path": "/health", "port": SERVER_PORT}, "periodSeconds": 10}}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(name, spec, labels),
                  "spec": {"replicas": 1, "selector": {"matchLabels": labels},  # CPU only: no accelerator placement
                           "template": {"metadata": {"labels": labels},
                                        "spec": {"containers": [container], **_pod_access(spec)}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, spec, labels),
               "spec": {"selector": labels, "ports": [{"name": "http", "port": SERVER_PORT, "targetPort": "http"}]}}
    return [deployment, service]


# ------------------------------------------------------------------------- config → manifests


def _on_volume(path: str, spec: ClusterSpec) -> str:
    return path if path.startswith("/") else f"{spec.mount_path.rstrip('/')}/{path}"


def _check_mesh(mesh: Any, spec: ClusterSpec, key: str) -> None:
    try:
        mesh.shape(spec.devices)
    except MeshError as e:
        raise K8sError(f"--hosts {spec.hosts} × --accelerators {spec.accelerators or '0 (one CPU device)'} = "
                       f"{spec.devices} device{'s' if spec.devices > 1 else ''}, which {key} cannot use: {e}") from None


def _distributed(section: dict[str, Any], hosts: int) -> None:
    if hosts > 1 and section["distributed"]["enabled"] is False:
        section["distributed"]["enabled"] = "auto"


def _rollout_servers(data: dict[str, Any], config: TrainConfig | MergeConfig, spec: ClusterSpec) -> list[Manifest]:
    """The policy's SGLang servers launched by the trainer become a LeaderWorkerSet it connects to."""
    rollout = config.rollout
    if rollout.engine != "sglang" or rollout.sglang.launch is None:
        return []
    if rollout.sglang.refit == "restart":
        raise K8sError("rollout.sglang.refit restart relaunches servers the trainer started; a cluster's "
                       "servers are pods of their own and are refitted from disk: set it to auto or disk")
    from opd_jax.train import INITIAL_WEIGHTS, sglang_server_flags
    name = f"{spec.name}-rollout"
    model = _on_volume(f"{config.logging.run_dir}/refit/{INITIAL_WEIGHTS}", spec)
    try:
        flags = sglang_server_flags(rollout)
    except ConfigError as e:
        raise K8sError(str(e)) from None
    group = server_group(name, spec, rollout.sglang.launch, model, flags, wait=True)
    urls = server_urls(name, rollout.sglang.launch.num_servers)
    sglang = data["rollout"]["sglang"]
    sglang.update(launch=None, urls=urls, refit="disk",
                  wait_for_servers_s=max(sglang["wait_for_servers_s"], WAIT_FOR_SERVERS_S))
    return [*group, *(router(spec, urls) if spec.router else [])]


def _teacher_servers(data: dict[str, Any], config: MergeConfig, spec: ClusterSpec) -> list[Manifest]:
    teachers = config.teachers
    if teachers.engine != "sglang" or teachers.sglang.launch is None:
        return []
    if not teachers.paths:
        raise K8sError("teachers.engine sglang on a cluster: name each teacher's model in teachers.paths (the "
                       "servers are rendered before the experts exist)")
    out, urls = [], {}
    for teacher, path in teachers.paths.items():
        name = f"{spec.name}-teacher-{to_label(teacher)}"
        out += server_group(name, spec, teachers.sglang.launch, _on_volume(path, spec), wait=True)
        urls[teacher] = server_urls(name, teachers.sglang.launch.num_servers)
    sglang = data["teachers"]["sglang"]
    sglang.update(launch=None, urls=urls, wait_for_servers_s=max(sglang["wait_for_servers_s"], WAIT_FOR_SERVERS_S))
    return out


def _rebuilt(config: BaseModel, data: dict[str, Any]) -> BaseModel:
    try:
        return type(config).model_validate(data)
    except ValueError as e:  # a rewrite the config's own checks refuse
        raise K8sError(f"the config rewritten for the cluster is invalid: {e}") from None


def _render_run(config: TrainConfig | MergeConfig, spec: ClusterSpec, kind: str) -> list[Manifest]:
    """A training run or a merge: its servers (rollouts; a merge's SGLang teachers) and its JobSet."""
    _check_mesh(config.mesh, spec, "mesh")
    data = to_plain(config)
    _distributed(data, spec.hosts)
    servers = _rollout_servers(data, config, spec)
    if isinstance(config, MergeConfig):
        servers += _teacher_servers(data, config, spec)
    run = jobset(spec.name, spec, ["--kind", kind, CONFIG_PATH], hosts=spec.hosts, component=kind)
    return [config_map(spec, _rebuilt(config, data)), *servers, run]


def _render_experts(config: ExpertsConfig, spec: ClusterSpec) -> list[Manifest]:
    _check_mesh(config.expert.mesh, spec, "expert.mesh")
    # the base's supervised warm start is one process: its JobSet has one pod
    _check_mesh(config.expert.mesh, dataclasses.replace(spec, hosts=1), "expert.mesh (the base's one pod)")
    if config.expert.rollout.engine == "sglang" and config.expert.rollout.sglang.launch is not None:
        raise K8sError("expert.rollout.engine sglang with launched servers: each expert would need a server group "
                       "of its own, which is not rendered; use the embedded engine for the experts, or running "
                       "servers (expert.rollout.sglang.urls)")
    data = to_plain(config)
    _distributed(data["expert"], spec.hosts)
    labels: dict[str, str] = {}
    for expert in config.experts:
        label = to_label(expert)
        if label in labels.values() or label == "base":
            clash = next((k for k, v in labels.items() if v == label), "base")
            raise K8sError(f"experts {clash!r} and {expert!r} have the same Kubernetes name {label!r}: rename one")
        labels[expert] = label
    base_json = f"{config.run_dir}/base/base.json"
    out = [config_map(spec, _rebuilt(config, data)),
           jobset(f"{spec.name}-base", spec, ["--kind", "experts", CONFIG_PATH, "--only", "base"], hosts=1,
                  component="base")]
    for expert, label in labels.items():
        out.append(jobset(f"{spec.name}-{label}", spec, ["--kind", "experts", CONFIG_PATH, "--only", expert],
                          hosts=spec.hosts, component=f"expert-{label}", wait_for=base_json))
    return out


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # labels repeated in full, not as &id001 anchors
        return True


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def dump_manifests(manifests: list[Manifest]) -> str:
    """One YAML stream for `kubectl apply -f` (the ConfigMap's config as a readable block)."""
    return yaml.dump_all(manifests, Dumper=_Dumper, sort_keys=False)


def render(config: BaseModel, spec: ClusterSpec) -> list[Manifest]:
    """The manifests of the run `config` describes (a TrainConfig, MergeConfig or ExpertsConfig)."""
    if isinstance(config, ExpertsConfig):
        return _render_experts(config, spec)
    if isinstance(config, MergeConfig):
        return _render_run(config, spec, "merge")
    if isinstance(config, TrainConfig):
        return _render_run(config, spec, "train")
    raise K8sError(f"cannot render a {type(config).__name__}: give a train, merge or experts config")
