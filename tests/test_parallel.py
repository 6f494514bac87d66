"""Sharding on 8 simulated CPU devices: the mesh from a config, parameters and optimizer state
really split by the logical-axis rules, and the sharded step equal to the unsharded one, in one
process and in two processes on loopback (started explicitly, or from a JobSet pod's environment)."""

import dataclasses
import functools
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx
from ppo_setup import (
    STEP_CONFIG,
    TINY,
    TINY_MOE,
    assert_updates_close,
    make_state,
    rollout_batch,
    scored_batch,
    step_optimizer,
)

from opd_jax.core import ppo_step
from opd_jax.core.packing import pack_batch
from opd_jax.models import Decoder, ModelConfig
from opd_jax.models.execution import Execution
from opd_jax.parallel import (
    DistributedConfig,
    DistributedError,
    JobSetPlace,
    MeshConfig,
    MeshError,
    batch_shardings,
    batch_shards,
    initialize_distributed,
    jobset_place,
    logical_spec,
    make_mesh,
    shard,
    sharded_step,
    tree_shardings,
    under_mesh,
)
from rollout_bridge.servers import free_port

# what each logical axis must be split over, written out independently of DEFAULT_RULES
EXPECTED_AXES = {"embed": ("fsdp",), "vocab": ("tensor",), "heads": ("tensor",), "kv_heads": ("tensor",),
                 "mlp": ("tensor",), "expert": ("data",)}


def test_mesh_shapes_from_config():
    assert MeshConfig().shape(8) == (8, 1, 1, 1)
    assert MeshConfig(data=2, fsdp=-1, tensor=2).shape(8) == (2, 2, 1, 2)
    assert MeshConfig(data=-1, fsdp=4).shape(8) == (2, 4, 1, 1)
    assert MeshConfig(data=1, sequence=-1).shape(8) == (1, 1, 8, 1)
    mesh = make_mesh(MeshConfig(data=2, fsdp=-1, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "sequence": 1, "tensor": 2} and mesh.devices.size == 8
    with pytest.raises(MeshError, match=r"mesh \(data=-1, fsdp=3, sequence=1, tensor=1\) does not divide 8 devices"):
        MeshConfig(data=-1, fsdp=3).shape(8)
    with pytest.raises(MeshError, match=r"needs 12 devices but 8 are available"):
        make_mesh(MeshConfig(data=2, fsdp=2, tensor=3))
    with pytest.raises(MeshError, match="only one mesh axis may be -1"):
        MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(MeshError, match="positive or -1"):
        MeshConfig(data=0)


def test_indivisible_dimensions_stay_replicated():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    # SmolLM2-135M: 9 heads, 3 KV heads, hidden 576: heads cannot split over tensor=2
    assert logical_spec(("layers", "embed", "heads", "head_dim"), (30, 576, 9, 64), mesh) == \
        jax.P(None, "fsdp", None, None)
    assert logical_spec(("vocab", "embed"), (49152, 576), mesh) == jax.P("tensor", "fsdp")
    with pytest.raises(ValueError, match="do not match an array of shape"):
        logical_spec(("vocab",), (4, 4), mesh)
    with pytest.raises(ValueError, match="a batch of 6 samples does not split over 4 data-parallel shards"):
        batch_shardings({"x": np.zeros((6, 3))}, mesh)


@pytest.fixture(scope="module")
def unsharded():
    state = make_state(step_optimizer(), step_optimizer())
    batch = scored_batch(state)
    new, metrics = jax.jit(functools.partial(ppo_step, config=STEP_CONFIG))(state, batch)
    return state, batch, new, metrics


def expected_shard_shape(var, mesh):
    shape = list(var[...].shape)
    for i, name in enumerate(var.get_metadata()["logical_axes"]):
        for axis in EXPECTED_AXES.get(name, ()):
            if shape[i] % mesh.shape[axis] == 0:
                shape[i] //= mesh.shape[axis]
    return tuple(shape)


def check_really_sharded(tree, mesh):
    """Every parameter-shaped leaf's local shard has the shape the rules promise; returns how many
    leaves are actually split."""
    split = 0
    for var in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        if not isinstance(var, nnx.Variable):
            continue
        want = expected_shard_shape(var, mesh)
        shards = var[...].addressable_shards
        assert len(shards) == 8 and all(s.data.shape == want for s in shards), (var.get_metadata(), want)
        split += want != var[...].shape
    return split


@pytest.mark.parametrize("mesh_shape, packed", [((8, 1, 1, 1), False), ((2, 4, 1, 1), False), ((2, 2, 1, 2), False),
                                               ((2, 2, 1, 2), True)])
def test_sharded_step_equals_unsharded(unsharded, mesh_shape, packed):
    """The sharded step equals the one-device one; packed (in groups of the data shards x two
    mini-batches, rows of twice the length), it equals the one-device step on padded rows."""
    state, batch, ref, ref_metrics = unsharded
    mesh = make_mesh(MeshConfig(*mesh_shape))
    if packed:
        batch = pack_batch(batch, math.lcm(batch_shards(mesh), STEP_CONFIG.update.minibatches), row_len=24)
        assert batch.packing[1] < batch.packing[0]
    sharded_state = shard(state, tree_shardings(state, mesh))
    sharded_batch = shard(batch, batch_shardings(batch, mesh))
    split = check_really_sharded((sharded_state.policy, sharded_state.critic, sharded_state.policy_opt,
                                  sharded_state.critic_opt), mesh)
    assert split > 0 if mesh_shape != (8, 1, 1, 1) else split == 0  # pure data parallel replicates weights
    rows = sharded_batch.tokens.addressable_shards[0].data.shape[0]
    assert rows == 16 // (mesh_shape[0] * mesh_shape[1])

    step = sharded_step(functools.partial(ppo_step, config=STEP_CONFIG), state, batch, mesh)
    new, metrics = step(sharded_state, sharded_batch)
    assert sharded_state.policy["backbone"]["embed"][...].is_deleted()  # donated
    check_really_sharded((new.policy, new.critic, new.policy_opt, new.critic_opt), mesh)
    # Adam's first steps divide by √v: compare the updates, relative to their size
    assert_updates_close((new.policy, new.critic), (ref.policy, ref.critic), (state.policy, state.critic))
    for name, value in ref_metrics.items():
        np.testing.assert_allclose(float(metrics[name]), float(value), rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("mesh_shape", [(2, 2, 1, 2)])
def test_sharded_moe_step_equals_unsharded(mesh_shape):
    """A MoE model's step with its experts split over the data axis equals the one-device step."""
    state = make_state(step_optimizer(), step_optimizer(), config=TINY_MOE)
    batch = scored_batch(state)
    ref, ref_metrics = jax.jit(functools.partial(ppo_step, config=STEP_CONFIG))(state, batch)
    mesh = make_mesh(MeshConfig(*mesh_shape))
    sharded_state = shard(state, tree_shardings(state, mesh))
    experts = sharded_state.policy["backbone"]["layers"]["expert_gate"][...]
    assert experts.addressable_shards[0].data.shape[1] == 4 // mesh_shape[0]  # experts really split
    check_really_sharded((sharded_state.policy, sharded_state.critic), mesh)
    step = sharded_step(functools.partial(ppo_step, config=STEP_CONFIG), state, batch, mesh)
    new, metrics = step(sharded_state, shard(batch, batch_shardings(batch, mesh)))
    # Adam's first update is g/√v: a router row with a near-zero gradient turns summation-order
    # noise into a few 1e-3 of the update's scale (a wrong dispatch would be O(1))
    assert_updates_close((new.policy, new.critic), (ref.policy, ref.critic), (state.policy, state.critic), rtol=5e-3)
    for name, value in ref_metrics.items():
        np.testing.assert_allclose(float(metrics[name]), float(value), rtol=1e-4, atol=1e-6, err_msg=name)


# Context parallelism through the long-sequence code paths: attention in blocks of 4 queries and
# keys, log-probs 5 tokens at a time, rows of 20 tokens (not a multiple of 8 sequence shards)
CP = Execution(attention="blockwise", attention_block=4, logits_chunk=5)


@pytest.mark.parametrize("mesh_shape, packed, remat", [((1, 1, 8, 1), False, "full"), ((2, 1, 2, 2), True, "none")])
def test_context_parallel_ppo_step_equals_one_device(mesh_shape, packed, remat):
    """Tokens split over the sequence axis (with data and tensor parallelism beside it, packed
    rows; the layers rematerialised, as past 2,048 tokens): the PPO step equals the one-device
    step, and a forward's hidden states are really split along the tokens."""
    state = make_state(step_optimizer(), step_optimizer(), execution=dataclasses.replace(CP, remat=remat))
    batch = scored_batch(state, T=20)
    ref, ref_metrics = jax.jit(functools.partial(ppo_step, config=STEP_CONFIG))(state, batch)
    mesh = make_mesh(MeshConfig(*mesh_shape))
    if packed:
        batch = pack_batch(batch, math.lcm(batch_shards(mesh), STEP_CONFIG.update.minibatches), row_len=40)
        assert batch.packing[1] < batch.packing[0]
    step = sharded_step(functools.partial(ppo_step, config=STEP_CONFIG), state, batch, mesh)
    new, metrics = step(shard(state, tree_shardings(state, mesh)), shard(batch, batch_shardings(batch, mesh)))
    assert_updates_close((new.policy, new.critic), (ref.policy, ref.critic), (state.policy, state.critic))
    for name, value in ref_metrics.items():
        np.testing.assert_allclose(float(metrics[name]), float(value), rtol=1e-4, atol=1e-6, err_msg=name)

    policy = nnx.merge(state.policy_def, state.policy)
    tokens = batch.tokens[:, :16]  # a multiple of the shards: an array split unevenly is not returned split
    hidden = under_mesh(jax.jit(lambda tokens: policy.backbone.forward(tokens)[0]), mesh)(tokens)
    assert hidden.sharding.spec[1] == "sequence"
    assert {s.data.shape[1] for s in hidden.addressable_shards} == {16 // mesh_shape[2]}


@pytest.mark.parametrize("loss", ["full", "top_k"])
def test_context_parallel_opd_step_equals_one_device(loss):
    """The OPD step (full-vocabulary and top-k reverse KL to two teachers) with the tokens split
    over 8 sequence shards equals the one-device step."""
    from test_opd_step import RUN, T_SAMPLE, distill_batch

    from opd_jax.core import OPDConfig, PolicyState, opd_step, score_student
    student = Decoder(TINY, rngs=nnx.Rngs(0)).set_execution(CP)
    state = PolicyState.create(student, step_optimizer())
    batch = score_student(state, rollout_batch(0, B=16, T=20), temperature=T_SAMPLE)
    batch = batch.replace(logp_infer=batch.logp_old)
    teachers = [Decoder(TINY, rngs=nnx.Rngs(10 + k)) for k in range(2)]
    distill = distill_batch(batch, teachers, np.arange(16) % 2, loss, top_k=8)
    step = functools.partial(opd_step, config=OPDConfig(loss=loss, top_k=8), **RUN)
    ref, ref_metrics = jax.jit(step)(state, distill)
    mesh = make_mesh(MeshConfig(data=1, sequence=8))
    new, metrics = sharded_step(step, state, distill, mesh)(shard(state, tree_shardings(state, mesh)),
                                                            shard(distill, batch_shardings(distill, mesh)))
    assert_updates_close(new.params, ref.params, state.params)
    for name, value in ref_metrics.items():
        np.testing.assert_allclose(np.asarray(metrics[name]), np.asarray(value), rtol=1e-4, atol=1e-6, err_msg=name)


def _two_processes(tmp_path, jobset: bool) -> Any:
    port, out = free_port(), tmp_path / "result.npz"
    worker = Path(__file__).with_name("multihost_worker.py")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # a JobSet pod's environment, as `opd-jax k8s render` writes it: one replicated job of two pods
    # (parallelism 2); JOBSET_COORDINATOR stands for the coordinator pod's hostname, on loopback
    pods = [{"JOBSET_NAME": "merge", "REPLICATED_JOB_NAME": "workers", "REPLICATED_JOB_REPLICAS": "1",
             "JOB_INDEX": "0", "JOB_COMPLETION_INDEX": str(i), "OPD_JAX_HOSTS_PER_JOB": "2",
             "JOBSET_COORDINATOR": "127.0.0.1", "OPD_JAX_COORDINATOR_PORT": str(port)} if jobset else {}
            for i in range(2)]
    procs = [subprocess.Popen([sys.executable, str(worker), str(port), str(i), str(out), *(["jobset"] if jobset else [])],
                              env={**env, **pods[i]}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=1800)[0])  # wide room: a loaded machine
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n\n".join(log[-3000:] for log in logs)
    return np.load(out)


@pytest.mark.parametrize("jobset", [False, True], ids=["explicit", "jobset_env"])
def test_two_processes_on_loopback_agree_with_one(unsharded, tmp_path, jobset):
    state, _, ref, ref_metrics = unsharded
    result = _two_processes(tmp_path, jobset)
    leaves = [result[f"leaf{i}"] for i in range(len(jax.tree.leaves(ref.policy)) + len(jax.tree.leaves(ref.critic)))]
    assert_updates_close(leaves, jax.tree.leaves((ref.policy, ref.critic)), jax.tree.leaves((state.policy, state.critic)))
    for name, value in ref_metrics.items():
        np.testing.assert_allclose(float(result[f"metric:{name}"]), float(value), rtol=1e-4, atol=1e-6, err_msg=name)


def test_jobset_place_follows_jobsets_naming():
    pod = {"JOBSET_NAME": "merge", "REPLICATED_JOB_NAME": "workers", "REPLICATED_JOB_REPLICAS": "2",
           "JOB_INDEX": "1", "JOB_COMPLETION_INDEX": "3", "OPD_JAX_HOSTS_PER_JOB": "4"}
    # job 1's pod 3 of two jobs of four pods: process 1·4 + 3 of 8; the coordinator is pod 0 of job 0
    assert jobset_place(pod) == JobSetPlace("merge-workers-0-0.merge:8476", 8, 7)
    assert jobset_place({**pod, "OPD_JAX_HOSTS_PER_JOB": ""}) == JobSetPlace("merge-workers-0-0.merge:8476", 2, 4)
    assert jobset_place({}) is None
    with pytest.raises(DistributedError, match="JOB_INDEX"):
        jobset_place({k: v for k, v in pod.items() if k != "JOB_INDEX"})
    with pytest.raises(DistributedError, match="JOB_COMPLETION_INDEX='x'"):
        jobset_place({**pod, "JOB_COMPLETION_INDEX": "x"})
    # auto outside a JobSet, or in a JobSet of one pod: a single process, jax.distributed untouched
    assert not initialize_distributed(DistributedConfig(enabled="auto"), env={})
    assert not initialize_distributed(DistributedConfig(enabled="auto"),
                                      env={**pod, "REPLICATED_JOB_REPLICAS": "1", "OPD_JAX_HOSTS_PER_JOB": "1"})


def test_rules_cover_every_parameter_name():
    config = ModelConfig(family="qwen2", vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=8, qkv_bias=True)
    from opd_jax.models import ValueModel
    from opd_jax.parallel import DEFAULT_RULES
    known = {name for name, _ in DEFAULT_RULES}
    for module in (Decoder(config), ValueModel(config), Decoder(TINY_MOE)):
        for var in jax.tree.leaves(nnx.state(module, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)):
            assert set(var.get_metadata()["logical_axes"]) <= known


def test_sharded_scoring_equals_unsharded(unsharded):
    from opd_jax.core import score_batch
    from opd_jax.parallel import sharded_scoring
    state, batch, _, _ = unsharded
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    scored = sharded_scoring(score_batch, state, batch, mesh)(shard(state, tree_shardings(state, mesh)),
                                                              shard(batch, batch_shardings(batch, mesh)))
    assert scored.logp_old.sharding.spec == jax.P(("data", "fsdp"), None)
    np.testing.assert_allclose(np.asarray(scored.logp_old), np.asarray(batch.logp_old), atol=2e-5)
    np.testing.assert_allclose(np.asarray(scored.old_values), np.asarray(batch.old_values), atol=2e-5)
