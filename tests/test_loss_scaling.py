"""FP16 training: a float16 model's optimizer carries a dynamic loss scale (jmp) in its state. A
step with it moves the parameters as the float32 step does, to float16 tolerance, where nothing
overflows; an overflowing step is skipped (parameters and optimizer kept), counted, and the scale
halves; finite updates double it after jmp's period."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from ppo_setup import make_state, scored_batch

from opd_jax.core import OptimizerConfig, PPOConfig, make_optimizer, ppo_step
from opd_jax.core.optim import LossScaledState, loss_scaled
from opd_jax.core.update import apply_update

SGD = OptimizerConfig(learning_rate=0.05, max_grad_norm=None)


def sgd_state(compute_dtype=None):
    """A PPO state whose optimizers are plain SGD (loss-scaled for a float16 model), so an
    update is −lr · gradient and can be compared directly."""
    def tx():
        inner = optax.sgd(SGD.learning_rate)
        return loss_scaled(inner) if compute_dtype == "float16" else inner
    return make_state(tx(), tx(), compute_dtype=compute_dtype)


def test_make_optimizer_scales_the_loss_for_float16_models_only():
    params = {"w": jnp.ones(3)}
    assert isinstance(make_optimizer(SGD, compute_dtype="float16").init(params), LossScaledState)
    for dtype in (None, "float32", "bfloat16"):
        assert not isinstance(make_optimizer(SGD, compute_dtype=dtype).init(params), LossScaledState)


def test_a_float16_step_moves_the_parameters_as_the_float32_step():
    f32, f16 = sgd_state(), sgd_state("float16")
    batch = scored_batch(f32)
    step = jax.jit(functools.partial(ppo_step, config=PPOConfig(), group_size=1))
    new32, _ = step(f32, batch)
    new16, metrics = step(f16, batch.replace(logp_old=scored_batch(f16).logp_old))
    assert float(metrics["policy/skipped_nonfinite"]) == 0 and float(metrics["policy/loss_scale"]) == 2.0 ** 15
    moved32 = jax.tree.map(lambda a, b: np.asarray(a - b, np.float64), new32.policy, f32.policy)
    moved16 = jax.tree.map(lambda a, b: np.asarray(a - b, np.float64), new16.policy, f16.policy)
    a, b = (np.concatenate([x.ravel() for x in jax.tree.leaves(m)]) for m in (moved32, moved16))
    assert np.abs(a).max() > 1e-4  # the step moved them
    # float16 activations (10-bit mantissa): the update agrees to about 1e-2 relative
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 3e-2, np.linalg.norm(a - b) / np.linalg.norm(a)
    assert np.corrcoef(a, b)[0, 1] > 0.999


def test_without_loss_scaling_float16_gradients_underflow():
    """What the scale is for: the float16 backward of a loss this small flushes gradients to zero."""
    tiny = jax.grad(lambda w: jnp.sum((w.astype(jnp.float16) * jnp.float16(1e-4)) ** 2).astype(jnp.float32))
    assert float(jnp.abs(tiny(jnp.full(4, 1e-3, jnp.float32))).max()) == 0.0
    scaled = jax.grad(lambda w: 2.0 ** 15 * jnp.sum((w.astype(jnp.float16) * jnp.float16(1e-4)) ** 2).astype(jnp.float32))
    assert float(jnp.abs(scaled(jnp.full(4, 1e-3, jnp.float32))).max()) > 0.0


def test_an_overflowing_step_is_skipped_counted_and_the_scale_backs_off():
    state = sgd_state("float16")
    huge = lambda opt: opt._replace(loss_scale=jnp.float32(2.0 ** 60))  # noqa: E731
    state = state.replace(policy_opt=huge(state.policy_opt), critic_opt=huge(state.critic_opt))
    new, metrics = jax.jit(functools.partial(ppo_step, config=PPOConfig(), group_size=1))(state, scored_batch(state))
    assert float(metrics["policy/skipped_nonfinite"]) == 1.0 and float(metrics["critic/skipped_nonfinite"]) == 1.0
    for a, b in zip(jax.tree.leaves(new.policy), jax.tree.leaves(state.policy)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(new.policy_opt.loss_scale) == 2.0 ** 59 and int(new.policy_opt.finite_updates) == 0


def test_apply_update_divides_out_the_scale_and_grows_it_after_its_period():
    tx = loss_scaled(optax.sgd(1.0), initial=8.0)
    params = {"w": jnp.zeros(2)}
    opt = tx.init(params)._replace(finite_updates=jnp.int32(1998))  # jmp's period: 2000 finite updates
    new, opt, metrics = apply_update(tx, params, opt, {"w": jnp.asarray([8.0, -16.0])})  # scaled by 8
    np.testing.assert_array_equal(np.asarray(new["w"]), [-1.0, 2.0])
    assert float(metrics["loss_scale"]) == 8.0 and float(metrics["skipped_nonfinite"]) == 0
    assert float(opt.loss_scale) == 8.0 and int(opt.finite_updates) == 1999
    new, opt, _ = apply_update(tx, new, opt, {"w": jnp.asarray([8.0, 8.0])})
    assert float(opt.loss_scale) == 16.0 and int(opt.finite_updates) == 0  # the 2000th: doubled
    kept, opt2, metrics = apply_update(tx, new, opt, {"w": jnp.asarray([jnp.inf, 1.0])})
    np.testing.assert_array_equal(np.asarray(kept["w"]), np.asarray(new["w"]))
    assert float(opt2.loss_scale) == 8.0 and float(metrics["skipped_nonfinite"]) == 1.0


def test_bfloat16_weights_keep_bfloat16_optimizer_state_under_a_float16_loss_scale():
    """model.dtype=bfloat16 with compute_dtype=float16: the unscaled gradients are float32, which
    turned Adam's moments float32 at the first update, so the PPO step's skip branch (the
    value warm-up's) no longer had the update's types and failed to trace."""
    tx = loss_scaled(optax.adam(1e-3), initial=8.0)
    params = {"w": jnp.ones(3, jnp.bfloat16)}
    opt = tx.init(params)
    new, new_opt, _ = apply_update(tx, params, opt, {"w": jnp.asarray([8.0, -16.0, 4.0], jnp.bfloat16)})
    assert new["w"].dtype == jnp.bfloat16
    assert jax.tree.map(lambda a: a.dtype, new_opt) == jax.tree.map(lambda a: a.dtype, opt)
    step = jax.jit(functools.partial(ppo_step, config=PPOConfig(value_warmup_steps=1), group_size=1))
    state = make_state(make_optimizer(SGD, compute_dtype="float16"), make_optimizer(SGD, compute_dtype="float16"),
                       compute_dtype="float16", param_dtype=jnp.bfloat16)
    new_state, metrics = step(state, scored_batch(state))  # traced both branches: no type mismatch
    assert float(metrics["policy/trained"]) == 0.0


def test_a_float16_run_trains_with_its_loss_scale_and_float16_parameters_are_refused(tmp_path):
    import json

    from test_cli_errors import assert_user_error, run_cli
    from train_loop_settings import TINY

    result = run_cli("train", *TINY, "steps=2", "sft.steps=1", "model.compute_dtype=float16", "rollout.dtype=float16",
                     f"logging.run_dir={tmp_path}", "logging.eval_every=100")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "policy/loss_scale" in r]
    assert trained and all(r["policy/loss_scale"] == 2.0 ** 15 and r["policy/skipped_nonfinite"] == 0 for r in trained)
    assert all(r["mismatch_abs_logp_diff"] < 1e-3 for r in trained)  # a float16 engine against a float16 trainer
    assert_user_error(run_cli("train", *TINY, "model.dtype=float16"), "model.dtype float16: keep float32 parameters")
