"""The engine-ratio ("bypass") mode, `algorithm.ppo.old_logprobs: engine`: θ_old's log-probs are
the engine's, no scoring pass runs the policy, and where engine and trainer agree the step is
the recompute step exactly; a correction between θ_old and the engine is refused with it."""

import functools

import jax
import numpy as np
import optax
import pytest
from ppo_setup import make_state, scored_batch
from test_cli_errors import assert_user_error, run_cli
from train_loop_settings import TINY

from opd_jax.core import MismatchCorrection, PPOConfig, SurrogateConfig, ppo_step, score_batch

NONE = SurrogateConfig(mismatch=MismatchCorrection("none"))


@pytest.mark.parametrize("advantage", ["gae", "grpo"])
def test_with_equal_log_probs_the_bypass_step_is_the_recompute_step(advantage):
    state = make_state(optax.adam(1e-2), optax.adam(1e-2))
    batch = scored_batch(state).replace(logp_old=None, old_values=None, end_values=None)
    recomputed = jax.jit(score_batch)(state, batch)
    # the engine's log-probs equal to the trainer's, bit for bit
    bypassed = jax.jit(functools.partial(score_batch, old_logprobs="engine"))(
        state, batch.replace(logp_infer=recomputed.logp_old))
    outs = []
    for mode, scored in (("recompute", recomputed.replace(logp_infer=recomputed.logp_old)), ("engine", bypassed)):
        config = PPOConfig(advantage=advantage, surrogate=NONE, old_logprobs=mode)
        outs.append(jax.jit(functools.partial(ppo_step, config=config, group_size=4))(state, scored))
    (a, ma), (b, mb) = outs
    for x, y in zip(jax.tree.leaves((a.policy, a.critic)), jax.tree.leaves((b.policy, b.critic))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert float(ma["policy/loss"]) == float(mb["policy/loss"])


def test_the_bypass_scoring_pass_runs_no_policy_forward():
    state = make_state(optax.sgd(0.1), optax.sgd(0.1))
    batch = scored_batch(state)
    recompute = str(jax.make_jaxpr(functools.partial(score_batch, old_logprobs="recompute"))(state, batch))
    engine = str(jax.make_jaxpr(functools.partial(score_batch, old_logprobs="engine"))(state, batch))
    assert engine.count("dot_general") < recompute.count("dot_general")  # the critic's pass only
    free = state.replace(critic=None, critic_opt=None, critic_def=None, critic_tx=None)
    assert "dot_general" not in str(jax.make_jaxpr(functools.partial(score_batch, old_logprobs="engine"))(free, batch))
    scored = score_batch(free, batch, old_logprobs="engine")
    np.testing.assert_array_equal(np.asarray(scored.logp_old), np.asarray(batch.logp_infer * batch.response_mask))


def test_a_bypass_run_trains_on_the_engines_log_probs(tmp_path):
    import json

    result = run_cli("train", *TINY, "steps=2", "sft.steps=1", "algorithm.ppo.old_logprobs=engine",
                     "algorithm.ppo.surrogate.mismatch.kind=none", "rollout.dtype=bfloat16",
                     f"logging.run_dir={tmp_path}", "logging.eval_every=100")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "policy/loss" in r]
    # θ_old is the (bf16) engine: the batch shows no mismatch, the first update's ratio carries it,
    # and its first forward measures it (bf16 against f32: above float noise, below a real gap)
    assert trained and all(r["mismatch_abs_logp_diff"] == 0 for r in trained)
    measured = [r["policy/engine_abs_logp_diff"] for r in trained]
    assert all(1e-6 < m < 0.1 for m in measured), measured
    assert f"|Δlogp| {np.mean(measured):.4f} (π_θ at each update’s first forward against the engine)" in result.output


def test_the_first_forward_measures_the_recompute_runs_mismatch_too():
    """In the recompute mode π_θ at the first update's forward is θ_old: its |Δlogp| against the
    engine equals the batch's figure, from NumPy on the scored batch."""
    state = make_state(optax.sgd(0.1), optax.sgd(0.1))
    scored = scored_batch(state)
    _, metrics = jax.jit(functools.partial(ppo_step, config=PPOConfig(surrogate=NONE), group_size=1))(state, scored)
    mask = np.asarray(scored.response_mask) > 0
    by_hand = np.abs(np.asarray(scored.logp_old) - np.asarray(scored.logp_infer))[mask].mean()
    np.testing.assert_allclose(float(metrics["policy/engine_abs_logp_diff"]), by_hand, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["mismatch_abs_logp_diff"]), by_hand, rtol=1e-5)


def test_a_correction_between_theta_old_and_the_engine_is_refused_with_it():
    with pytest.raises(ValueError, match="icepop .* has nothing to correct"):
        PPOConfig(old_logprobs="engine")
    PPOConfig(old_logprobs="engine", surrogate=SurrogateConfig(mismatch=MismatchCorrection("offpolicy-mask", hi=1.0)))
    assert_user_error(run_cli("train", *TINY, "algorithm.ppo.old_logprobs=engine"),
                      "old_logprobs engine takes the engine's log-probs as θ_old, so icepop")
