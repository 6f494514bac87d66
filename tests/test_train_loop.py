"""The training loop end to end at test size, on a (2, 2, 2) mesh of simulated devices: reward
rises; the run the fault tests interrupt and resume (tests/test_safe_runs.py) trains a MoE policy
on the engine's routing beside a frozen KL reference; bad data and NaN rewards stop the run with
the culprit named."""

import json

import jax
import numpy as np
import pytest
from train_loop_settings import TINY, like_state

from opd_jax.config import ConfigError, load_config
from opd_jax.data import DataError
from opd_jax.train import RunError, train
from opd_jax.train.checkpoint import Checkpoints
from opd_jax.train.metrics import read_metrics, run_summary

# with pytest-xdist, one worker runs every test of conftest's straight_run (computed once per worker)
pytestmark = pytest.mark.xdist_group("straight_run")


def config(tmp_path, *extra):
    return load_config(None, [*TINY, f"logging.run_dir={tmp_path}", *extra])


def test_reward_rises_on_an_easy_domain(tmp_path):
    run = train(config(tmp_path, "steps=40", "sft.steps=20", "sft.batch_size=32", "sft.optimizer.learning_rate=3e-3",
                       "algorithm.policy_optimizer.learning_rate=1e-3", "algorithm.critic_optimizer.learning_rate=1e-3",
                       "rollout.samples_per_prompt=8", "logging.eval_every=40", "checkpoint.every=40"))
    rows = read_metrics(run / "metrics.jsonl")
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    assert len(rewards) == 40
    before, after = rows[0]["eval/accuracy"], rows[-1]["eval/accuracy"]
    # measured here: reward 0.24 -> 0.41 (first vs last 10 steps), held-out accuracy 0.47 -> 0.66
    assert np.mean(rewards[-10:]) > np.mean(rewards[:10]) + 0.08, rewards
    assert after > before + 0.08, (before, after)
    assert all(np.isfinite(r["policy/loss"]) and np.isfinite(r["critic/loss"]) for r in rows[1:])
    assert (run / "config.yaml").exists() and (run / "warm_start" / "metrics.jsonl").exists()


def test_the_shared_run_trains_a_moe_policy_on_the_engines_routing_with_a_frozen_kl_reference(straight_run):
    """The run every interrupted and resumed one must equal (its faults: tests/test_safe_runs.py)."""
    rows = read_metrics(straight_run / "metrics.jsonl")
    # the critic's warm-up step logs no policy numbers (the skipped update's zeros are not measured)
    assert rows[1]["policy/trained"] == 0 and not any(k.startswith("policy/") for k in rows[1] if k != "policy/trained")
    assert rows[2]["policy/trained"] == 1 and rows[2]["policy/entropy"] > 0.1
    assert "policy/moe/layer1/flip_frac" in rows[-1]  # a MoE policy, trained on the engine's routing
    flips = np.mean([r["policy/moe/flip_frac"] for r in rows if "policy/moe/flip_frac" in r])
    assert flips > 0  # the engine's routing reached the step (its weights are perturbed)
    assert f"routing flips {flips:.2%} of token-layers" in run_summary(straight_run, {})
    checkpoints = Checkpoints(straight_run / "checkpoints", keep=3)
    try:
        state, _ = checkpoints.restore(checkpoints.latest_step(), like_state(straight_run))
    finally:
        checkpoints.close()
    assert int(state.step) == 6
    # the KL term's reference is the warm-started policy, frozen: at the first trained step (one
    # update; the critic's warm-up step left the policy as it was) the KL to it is 0, then it grows
    # (slowly: the learning rate warms up from 0; measured 0, 0, 7.5e-9, 1.6e-8, 2.7e-8)
    assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(state.policy), jax.tree.leaves(state.reference)))
    kl = [r["policy/kl_loss"] for r in rows if "policy/kl_loss" in r]
    assert len(kl) == 5 and kl[0] < 1e-12 and 0 < kl[2] < kl[3] < kl[4], kl


def test_bad_data_and_nan_rewards_stop_the_run(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1=", "answer": 2}) + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        train(config(tmp_path / "a", "steps=2", f"data.train=[{{jsonl: {bad}}}]"))
    assert not (tmp_path / "a" / "metrics.jsonl").exists()
    # NaN on the reference answer: named before the run (nothing built, nothing written)
    with pytest.raises(ConfigError, match=r"data.reward_fn, checked on the reference answers before the run: reward of "
                                          r"sample 0 \(domain 'max', prompt max/eval/0\) is nan, returned by reward "
                                          r"function nan_reward:reward \(data.on_bad_reward: skip drops such samples\)"):
        train(config(tmp_path / "b", "steps=2", "data.reward_fn=nan_reward:reward"))
    assert not (tmp_path / "b").exists()
    # NaN only on wrong answers: the evaluation and the training rollouts are checked as they come
    with pytest.raises(RunError, match=r"evaluation at step 0: reward of sample \d+ \(domain 'max', prompt max/eval/"):
        train(config(tmp_path / "b", "steps=2", "data.reward_fn=nan_reward:nan_unless_right"))
    with pytest.raises(RunError, match=r"step 1: reward of sample \d+ \(domain 'max', prompt max/train/"):
        train(config(tmp_path / "c", "steps=2", "data.reward_fn=nan_reward:nan_unless_right",
                     "logging.eval_at_start=false"))
