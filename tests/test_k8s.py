"""Cluster manifests: what `opd-jax k8s render` writes for the quickstart, the SGLang quickstart,
the merge and its experts validates against the schemas of its kinds (kubernetes-validate for core
kinds, the JobSet / LeaderWorkerSet CRDs' published schemas), a misspelt field is caught, the
pods' environment gives each process its place (the same rule `distributed: auto` reads), the
config the pods run is the rewritten one, a pod restarted by its JobSet continues the run, and bad
flags are one line naming them. (No cluster is reachable here: everything up to the API server.)"""

import copy
import re
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from flax import nnx
from test_cli_errors import assert_user_error, run_cli
from train_loop_settings import TINY

from opd_jax.config import ExpertsConfig, MergeConfig, TrainConfig, load_config
from opd_jax.k8s import ClusterSpec, K8sError, render, run_in_pod, validate_manifests
from opd_jax.k8s.validate import validate_manifest
from opd_jax.parallel import JobSetPlace, jobset_place

CONFIGS = Path(__file__).parents[1] / "configs"
IMAGE, SERVER_IMAGE = "registry.example/opd-jax:1.0", "registry.example/sglang:0.5"


def spec(**kw) -> ClusterSpec:
    return ClusterSpec(**{"image": IMAGE, "queue": "team-a", "name": "run", **kw})


def by_kind(manifests, kind):
    return [m for m in manifests if m["kind"] == kind]


def pod_spec(jobset):
    return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def pod_config(manifests, schema):
    """The config the pods run, read back from the ConfigMap as `opd-jax k8s run` reads it."""
    (cm,) = by_kind(manifests, "ConfigMap")
    return schema.model_validate(yaml.safe_load(cm["data"]["config.yaml"]))


def test_quickstart_on_two_hosts_validates_and_each_pod_finds_its_place():
    config = load_config(CONFIGS / "quickstart.yaml")
    manifests = render(config, spec(hosts=2, accelerators=4, memory="64Gi", priority_class="high",
                                    node_selector=(("pool", "gpu"),), env=(("HF_TOKEN", "x"),),
                                    service_account="trainer", image_pull_secrets=("registry",)))
    assert validate_manifests(manifests) == []
    (js,) = by_kind(manifests, "JobSet")
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert js["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "high"
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["backoffLimit"]) == (2, 2, 0)
    container = pod_spec(js)["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 4, "memory": "64Gi"}
    assert container["command"] == ["opd-jax", "k8s", "run", "--kind", "train", "/etc/opd-jax/config.yaml"]
    assert pod_spec(js)["nodeSelector"] == {"pool": "gpu"}
    assert pod_spec(js)["serviceAccountName"] == "trainer" and pod_spec(js)["imagePullSecrets"] == [{"name": "registry"}]
    assert {"name": "HF_TOKEN", "value": "x"} in container["env"]
    rewritten = pod_config(manifests, TrainConfig)
    assert rewritten.distributed.enabled == "auto"
    assert rewritten.model_copy(update={"distributed": config.distributed}) == config  # nothing else changed
    # the pod's environment as Kubernetes fills it in: JobSet's annotations through the downward
    # API, the Indexed Job's JOB_COMPLETION_INDEX; JobSet's coordinator annotation left unset
    # here, so the hostname comes from JobSet's naming rule
    annotations = {"jobset.sigs.k8s.io/jobset-name": "run", "jobset.sigs.k8s.io/replicatedjob-name": "workers",
                   "jobset.sigs.k8s.io/replicatedjob-replicas": "1", "jobset.sigs.k8s.io/job-index": "0"}
    places = []
    for index in range(2):
        env = {"JOB_COMPLETION_INDEX": str(index)}
        for var in container["env"]:
            if "value" in var:
                env[var["name"]] = var["value"]
            else:
                key = re.fullmatch(r"metadata\.annotations\['(.+)'\]", var["valueFrom"]["fieldRef"]["fieldPath"])[1]
                env[var["name"]] = annotations.get(key, "")
        places.append(jobset_place(env))
    coordinator = f"run-{js['spec']['coordinator']['replicatedJob']}-0-0.run:8476"
    assert places == [JobSetPlace(coordinator, 2, 0), JobSetPlace(coordinator, 2, 1)]


def test_sglang_quickstart_runs_its_servers_as_a_leader_worker_set_behind_a_router():
    config = load_config(CONFIGS / "quickstart_sglang.yaml", ["rollout.sglang.launch.num_servers=2"])
    manifests = render(config, spec(server_image=SERVER_IMAGE, server_accelerators=1))
    assert validate_manifests(manifests) == []
    (lws,) = by_kind(manifests, "LeaderWorkerSet")
    assert lws["spec"]["replicas"] == 2 and lws["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    server = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert server["image"] == SERVER_IMAGE and server["resources"]["limits"] == {"nvidia.com/gpu": 1}
    script = server["command"][2]
    # the servers boot on the policy the trainer writes to the shared volume, then are refitted from disk
    initial = "/workspace/runs/quickstart_sglang/refit/initial"
    assert f"until [ -e {initial}/config.json ]" in script
    assert f"exec python -m sgl_jax.launch_server --model-path {initial} --host 0.0.0.0 --port 30000" in script
    urls = ["http://run-rollout-0.run-rollout:30000", "http://run-rollout-1.run-rollout:30000"]
    sglang = pod_config(manifests, TrainConfig).rollout.sglang
    assert (sglang.launch, sglang.urls, sglang.refit, sglang.wait_for_servers_s) == (None, urls, "disk", 1800.0)
    leaders, service = (m for m in by_kind(manifests, "Service"))
    assert leaders["metadata"]["name"] == "run-rollout-leaders"
    assert leaders["spec"]["selector"] == {"leaderworkerset.sigs.k8s.io/name": "run-rollout",
                                           "leaderworkerset.sigs.k8s.io/worker-index": "0"}
    deployment = by_kind(manifests, "Deployment")[0]
    router = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert router[router.index("--worker-urls") + 1:router.index("--host")] == urls
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert not by_kind(render(config, spec(server_image=SERVER_IMAGE, router=False)), "Deployment")


def test_merge_and_its_experts_validate():
    merge = load_config(CONFIGS / "merge.yaml", schema=MergeConfig)
    manifests = render(merge, spec(name="merge"))
    assert validate_manifests(manifests) == []
    assert [m["kind"] for m in manifests] == ["ConfigMap", "JobSet"]  # local teachers: no servers
    assert pod_config(manifests, MergeConfig) == merge  # one host: the config as it is

    experts = load_config(CONFIGS / "merge_experts.yaml", schema=ExpertsConfig)
    manifests = render(experts, spec(name="experts", hosts=2))
    assert validate_manifests(manifests) == []
    jobsets = {m["metadata"]["name"]: m for m in by_kind(manifests, "JobSet")}
    # one JobSet per expert (a failed one restarts alone), each waiting for the base on the volume
    assert set(jobsets) == {"experts-base", *(f"experts-{n.replace('_', '-')}" for n in experts.experts)}
    for name, expert in zip([n.replace("_", "-") for n in experts.experts], experts.experts):
        pod = pod_spec(jobsets[f"experts-{name}"])
        assert pod["containers"][0]["command"][-2:] == ["--only", expert]
        assert f"until [ -e {experts.run_dir}/base/base.json ]" in pod["initContainers"][0]["command"][2]
    assert pod_spec(jobsets["experts-base"])["containers"][0]["command"][-2:] == ["--only", "base"]
    assert "initContainers" not in pod_spec(jobsets["experts-base"])
    assert jobsets["experts-base"]["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] == 1
    assert pod_config(manifests, ExpertsConfig).expert.distributed.enabled == "auto"


def test_sglang_teachers_get_a_server_group_each():
    merge = load_config(None, ["experts_dir=runs/x", "teachers.engine=sglang", "opd.loss=sampled",
                                                 "teachers.paths={copy_edit: runs/x/copy_edit, sort: runs/x/sort}",
                                                 "teachers.sglang.launch.command=[python, -m, sglang.launch_server, "
                                                 "--model-path, '{model_path}', --port, '{port}']"], schema=MergeConfig)
    manifests = render(merge, spec(name="merge", server_image=SERVER_IMAGE))
    assert validate_manifests(manifests) == []
    groups = {m["metadata"]["name"]: m for m in by_kind(manifests, "LeaderWorkerSet")}
    assert set(groups) == {"merge-teacher-copy-edit", "merge-teacher-sort"}
    assert pod_config(manifests, MergeConfig).teachers.sglang.urls == {
        "copy_edit": ["http://merge-teacher-copy-edit-0.merge-teacher-copy-edit:30000"],
        "sort": ["http://merge-teacher-sort-0.merge-teacher-sort:30000"]}


def test_validation_bites():
    manifests = render(load_config(CONFIGS / "quickstart_sglang.yaml"), spec(server_image=SERVER_IMAGE))
    jobset, deployment = by_kind(manifests, "JobSet")[0], by_kind(manifests, "Deployment")[0]
    lws = by_kind(manifests, "LeaderWorkerSet")[0]
    wrong = copy.deepcopy(jobset)  # a misspelt field deep in the CRD's Job template
    wrong["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelizm"] = 2
    assert validate_manifest(wrong) == ["JobSet/run: spec.replicatedJobs[0].template.spec: unknown field 'parallelizm'"]
    wrong = copy.deepcopy(jobset)  # a value of the wrong type
    wrong["spec"]["failurePolicy"]["maxRestarts"] = "three"
    assert validate_manifest(wrong) == ["JobSet/run: spec.failurePolicy.maxRestarts: 'three' is not of type 'integer'"]
    wrong = copy.deepcopy(lws)
    del wrong["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["image"]
    wrong["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Sometimes"
    problems = validate_manifest(wrong)
    assert len(problems) == 1 and "restartPolicy: 'Sometimes' is not one of" in problems[0]
    wrong = copy.deepcopy(deployment)  # a core kind: kubernetes-validate's schema
    wrong["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    assert validate_manifest(wrong) == ["Deployment/run-router: spec.template.spec.containers[0]: unknown field "
                                        "'imagePullPolicyy'"]


def test_bad_flags_are_one_line_naming_them(tmp_path):
    base = ["k8s", "render", CONFIGS / "quickstart.yaml"]
    ok = ["--image", IMAGE, "--queue", "team-a"]
    assert_user_error(run_cli(*base, "--queue", "team-a"), "--image is required")
    assert_user_error(run_cli(*base, "--image", IMAGE), "--queue is required")
    assert_user_error(run_cli(*base, "--image", IMAGE, "--queue", "Team_A"), "--queue 'Team_A' is not a valid Kubernetes name")
    assert_user_error(run_cli(*base, *ok, "mesh.tensor=2", "--accelerators", "3"),
                      "--hosts 1 × --accelerators 3 = 3 devices, which mesh cannot use")
    assert_user_error(run_cli("k8s", "render", CONFIGS / "merge_experts.yaml", *ok, "--hosts", "2", "expert.mesh.data=2"),
                      "--hosts 1 × --accelerators 0 (one CPU device) = 1 device, which expert.mesh (the base's one pod)")
    assert_user_error(run_cli("k8s", "render", CONFIGS / "recipe.yaml", *ok), "is a recipe")
    assert_user_error(run_cli(*base, *ok, "--env", "NOEQUALS"), "--env 'NOEQUALS': expected key=value")
    assert_user_error(run_cli(*base, *ok, "--memory", "lots"), "--memory 'lots' is not a Kubernetes quantity")
    assert_user_error(run_cli(*base, *ok, "--toleration", "gpu:Sometimes"), "--toleration 'gpu:Sometimes'")
    assert_user_error(run_cli(*base, *ok, "--name", "x" * 60), "--name")
    assert_user_error(run_cli("k8s", "render", CONFIGS / "quickstart_sglang.yaml", *ok), "--server-image is required")
    assert_user_error(run_cli("k8s", "render", CONFIGS / "quickstart_sglang.yaml", *ok, "--server-image", SERVER_IMAGE,
                              "rollout.sglang.refit=restart"), "rollout.sglang.refit restart")
    result = run_cli(*base, *ok, "--check", "--out", tmp_path / "run.yaml")
    assert result.exit_code == 0, result.output
    assert "2 manifests valid: ConfigMap/quickstart-config, JobSet/quickstart" in result.output
    assert [d["kind"] for d in yaml.safe_load_all((tmp_path / "run.yaml").read_text())] == ["ConfigMap", "JobSet"]
    with pytest.raises(K8sError, match="--hosts 0"):
        spec(hosts=0)


def test_a_restarted_pod_continues_the_run(tmp_path):
    config = load_config(None, [*TINY, "mesh.data=-1", "mesh.fsdp=1", "mesh.tensor=1", "steps=2", "checkpoint.every=1",
                                "logging.eval_every=100", f"logging.run_dir={tmp_path / 'run'}"])
    from opd_jax.train import read_metrics, train
    train(config, stop_after=1)  # the pod was killed after its first checkpoint
    assert run_in_pod(config) == f"run written to {tmp_path / 'run'}"  # resumed: no refusal to overwrite
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "policy/loss" in r] == [1, 2]
    assert run_in_pod(config) == f"{tmp_path / 'run'} is finished already; nothing to do"


def test_with_running_servers_the_trainer_writes_the_model_they_boot_on(tmp_path):
    # a cluster's servers wait for RUN_DIR/refit/initial before they start; the trainer writes it
    # before it looks for them (here nothing answers, so it stops there)
    from opd_jax.models import load_model
    from opd_jax.train import INITIAL_WEIGHTS, build_model
    from opd_jax.train.engines import make_engine, weight_update
    from rollout_bridge.protocol import EngineError
    config = load_config(None, [*TINY, "rollout.engine=sglang", "rollout.sglang.urls=[http://127.0.0.1:9]"])
    policy, tokenizer = build_model(config.model)
    params = nnx.state(policy, nnx.Param)
    with pytest.raises(EngineError, match="no server answered"):
        make_engine(config.rollout, 0, weight_update(config.rollout, policy.config, params, tokenizer, 0),
                    max_cache_len=32, pad_id=0, refit_dir=tmp_path / "refit")
    booted, _ = load_model(tmp_path / "refit" / INITIAL_WEIGHTS)
    for a, b in zip(jax.tree.leaves(nnx.state(booted, nnx.Param)), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
