"""One of two processes of a jax.distributed job on loopback (4 CPU devices each) that runs the
sharded PPO step on a (2, 2, 2) mesh over all 8 devices. Process 0 writes the result.

usage: python multihost_worker.py PORT PROCESS_ID OUT.npz [jobset]

With `jobset`, the process finds its place as a JobSet pod does (`distributed: auto`): from the
environment its parent gives it (JOBSET_NAME, JOB_COMPLETION_INDEX, ...), not from arguments.
"""

import os
import sys

from xla_env import xla_flags  # this script's folder is on sys.path

os.environ["XLA_FLAGS"] = xla_flags(4)
os.environ["JAX_PLATFORMS"] = "cpu"

import functools  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from jax.experimental import multihost_utils  # noqa: E402

from opd_jax.core import ppo_step  # noqa: E402
from opd_jax.parallel import (  # noqa: E402
    DistributedConfig,
    MeshConfig,
    batch_shardings,
    global_batch,
    initialize_distributed,
    make_mesh,
    shard,
    sharded_step,
    tree_shardings,
)


def main(port: str, process_id: str, out: str, mode: str = "explicit") -> None:
    if mode == "jobset":
        assert os.environ["JOB_COMPLETION_INDEX"] == process_id
        assert initialize_distributed(DistributedConfig(enabled="auto"))
    else:
        assert initialize_distributed(DistributedConfig(enabled=True, coordinator_address=f"127.0.0.1:{port}",
                                                        num_processes=2, process_id=int(process_id)))
    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    sys.path.insert(0, os.path.dirname(__file__))
    from ppo_setup import STEP_CONFIG, make_state, scored_batch, step_optimizer

    state = make_state(step_optimizer(), step_optimizer())
    batch = scored_batch(state)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    state_sh, batch_sh = tree_shardings(state, mesh), batch_shardings(batch, mesh)
    # each process contributes only its own half of the rows; the result must equal the full batch
    rows = batch.tokens.shape[0] // 2
    local = jax.tree.map(lambda x: np.asarray(x)[jax.process_index() * rows:(jax.process_index() + 1) * rows], batch)
    from_local = global_batch(local, batch_sh)
    for a, b in zip(jax.tree.leaves(multihost_utils.process_allgather(from_local, tiled=True)),
                    jax.tree.leaves(batch)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    step = sharded_step(functools.partial(ppo_step, config=STEP_CONFIG), state, batch, mesh)
    new, metrics = step(shard(state, state_sh), from_local)
    params = multihost_utils.process_allgather((new.policy, new.critic), tiled=True)
    metrics = {k: np.asarray(v.addressable_data(0)) for k, v in metrics.items()}  # replicated
    if jax.process_index() == 0:
        leaves = {f"leaf{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(params))}
        np.savez(out, **leaves, **{f"metric:{k}": np.asarray(v) for k, v in metrics.items()})
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
