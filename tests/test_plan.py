"""`opd-jax plan`: each step of a config compiled ahead of time on abstract arrays for a mesh of N
devices. Its per-device weights and optimizer state equal those of the real state placed on that
mesh; its step's arguments are that state and the batch; a config over --hbm is one line and exit
1, and `k8s render --hbm` refuses it the same way; remat's `auto` switches at its length."""

from pathlib import Path

import jax
import numpy as np
import pytest
from test_cli_errors import run_cli

from opd_jax.config import TrainConfig, load_config
from opd_jax.models.execution import REMAT_FROM, Execution
from opd_jax.parallel import make_mesh, shard, tree_shardings
from opd_jax.train.build import add_configured_adapters, build_model
from opd_jax.train.loop import PPOTask
from opd_jax.train.plan import plan_train

QUICKSTART = Path(__file__).parents[1] / "configs" / "quickstart.yaml"
SMALL = ["sft.steps=0", "data.prompts_per_step=4", "rollout.samples_per_prompt=2"]


def one_device_bytes(tree) -> int:
    """Bytes that device 0 holds of `tree`'s placed arrays."""
    return sum(shard.data.nbytes for x in jax.tree.leaves(tree) for shard in x.addressable_shards
               if shard.device == jax.devices()[0])


def test_the_plan_holds_each_devices_share_of_the_real_state_on_an_fsdp_and_tensor_mesh():
    config = load_config(QUICKSTART, [*SMALL, "mesh.fsdp=2", "mesh.tensor=2"], schema=TrainConfig)
    plan = plan_train(config, jax.devices()[:8], tokens=24)
    assert plan.mesh == {"data": 2, "fsdp": 2, "sequence": 1, "tensor": 2} and (plan.rows, plan.tokens) == (8, 24)

    task = PPOTask(config)  # the state as a run builds it, placed as the runner places it
    task.policy = add_configured_adapters(build_model(config.model)[0], config.model, config.seed)
    state = task.create_state()
    mesh = make_mesh(config.mesh, jax.devices()[:8])
    placed = shard(state, tree_shardings(state, mesh))
    assert plan.weights == one_device_bytes((placed.policy, placed.critic, placed.reference))
    assert plan.optimizer == one_device_bytes((placed.policy_opt, placed.critic_opt))
    total = sum(x.nbytes for x in jax.tree.leaves(state))
    assert plan.weights + plan.optimizer < total / 2  # sharded, not replicated

    step, scoring = plan.programs
    assert (step.name, scoring.name) == ("ppo step", "scoring (θ_old)")
    # the step reads the state and the batch: 8 rows × 24 tokens, a quarter of them per device
    # (batch over data × fsdp), at most 8 [B, T] fields of 4 bytes and a few [B] ones
    state_bytes = plan.weights + plan.optimizer
    assert state_bytes < step.arguments <= state_bytes + 2 * 24 * 8 * 4 + 64
    assert step.aliased > 0.9 * state_bytes  # the state is donated: the new one is written over it
    assert step.peak == step.arguments + step.outputs - step.aliased + step.temporaries > state_bytes
    assert plan.peak == max(step.peak, scoring.peak)
    assert plan.fits(plan.peak / 2**30) and not plan.fits(0.99 * plan.peak / 2**30)


def test_a_config_over_hbm_prints_its_table_and_one_line_and_exits_1():
    result = run_cli("plan", QUICKSTART, *SMALL, "--devices", 2, "--tokens", 16, "--hbm", 0.001)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert "| ppo step |" in result.output and "| scoring (θ_old) |" in result.output
    assert "2 devices (mesh data=2, fsdp=1, sequence=1, tensor=1); a step's batch: 8 rows × 16 tokens" in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "does not fit: the peak is" in errors[0] and "over 0.001 GiB" in errors[0], errors
    assert "of 0.001 GiB: does not fit" in result.output


def test_k8s_render_refuses_a_config_its_accelerators_cannot_hold():
    result = run_cli("k8s", "render", QUICKSTART, *SMALL, "--image", "i", "--queue", "q", "--hosts", 2,
                     "--accelerators", 1, "--hbm", 0.001)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "--hbm 0.001:" in errors[0] and "does not fit" in errors[0], result.output
    assert "on 2 devices" in errors[0] and "kind: JobSet" not in result.output


def test_more_devices_than_this_process_has_is_one_line():
    result = run_cli("plan", QUICKSTART, "--devices", 64)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "--devices 64: this process has 8 CPU devices" in result.output


@pytest.mark.parametrize("length, expected", [(REMAT_FROM, None), (REMAT_FROM + 1, "full")])
def test_remat_auto_rematerialises_only_past_its_length(length, expected):
    full = Execution(remat="full").checkpoint_policy(length)
    assert Execution().checkpoint_policy(length) is (None if expected is None else full)
    assert Execution(remat="none").checkpoint_policy(np.int64(length)) is None
