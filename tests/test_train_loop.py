"""The training loop end to end at test size, on a (2, 2, 2) mesh of simulated devices: reward
rises; a killed and resumed run (of a MoE policy with routing replay) ends exactly where an
uninterrupted one does; an incomplete
checkpoint is skipped; bad data and NaN rewards stop the run with the culprit named."""

import json

import jax
import numpy as np
import pytest
from train_loop_settings import RESUME_ARGS, TINY, like_state

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


def final_params(run_dir, like):
    checkpoints = Checkpoints(run_dir / "checkpoints", keep=2)
    state, meta = checkpoints.restore(checkpoints.latest_step(), like)
    checkpoints.close()
    return state, meta


TIMING = ("rollout/tokens_per_s", "rollout/wait_s", "rollout/refit_s")  # wall-clock, differs run to run


def test_killed_and_resumed_run_matches_an_uninterrupted_one(tmp_path, straight_run):
    straight = straight_run
    interrupted = config(tmp_path / "resumed", *RESUME_ARGS)
    train(interrupted, stop_after=3)  # "killed" after step 3: the last checkpoint is step 2
    with pytest.raises(RunError, match="already holds checkpoints .* pass --resume"):
        train(interrupted)
    # a kill in the middle of saving step 4 leaves an unfinished directory behind
    partial = tmp_path / "resumed" / "checkpoints" / "4.orbax-checkpoint-tmp-1234567890"
    partial.mkdir()
    (partial / "garbage").write_text("half written")
    resumed = train(interrupted, resume=True)

    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    rows = read_metrics(straight / "metrics.jsonl")
    assert strip(read_metrics(resumed / "metrics.jsonl")) == strip(rows)
    # the critic's warm-up step logs no policy numbers (the skipped update's zeros are not measured)
    assert rows[1]["policy/trained"] == 0 and not any(k.startswith("policy/") for k in rows[1] if k != "policy/trained")
    assert rows[2]["policy/trained"] == 1 and rows[2]["policy/entropy"] > 0.1
    assert "policy/moe/layer1/flip_frac" in rows[-1]  # a MoE policy, trained on the engine's routing
    flips = np.mean([r["policy/moe/flip_frac"] for r in rows if "policy/moe/flip_frac" in r])
    assert flips > 0  # the engine's routing reached the step (its weights are perturbed)
    assert f"routing flips {flips:.2%} of token-layers" in run_summary(straight, {})
    a, meta_a = final_params(straight, like_state(straight))
    b, meta_b = final_params(resumed, like_state(straight))
    assert meta_a == meta_b and int(a.step) == int(b.step) == 6
    for x, y in zip(jax.tree.leaves((a.policy, a.critic, a.policy_opt, a.reference)),
                    jax.tree.leaves((b.policy, b.critic, b.policy_opt, b.reference))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # the KL term's reference is the warm-started policy, frozen: at the first trained step (one
    # update; the critic's warm-up step left the policy as it was) the KL to it is 0, then it grows
    # (slowly: the learning rate warms up from 0; measured 0, 0, 7.5e-9, 1.6e-8, 2.7e-8)
    assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a.policy), jax.tree.leaves(a.reference)))
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


def test_a_real_kill_during_a_checkpoint_save_resumes_exactly(tmp_path, straight_run):
    """SIGKILL in the middle of saving step 4; the resumed run ends as an uninterrupted one."""
    import subprocess
    import sys
    from pathlib import Path
    worker = Path(__file__).with_name("kill_during_save.py")
    killed = subprocess.run([sys.executable, str(worker), str(tmp_path / "killed")], capture_output=True, text=True,
                            timeout=1800)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert [p.name for p in (tmp_path / "killed" / "checkpoints").iterdir() if "tmp" in p.name] == ["4.orbax-checkpoint-tmp"]
    assert Checkpoints(tmp_path / "killed" / "checkpoints", keep=2).latest_step() == 2  # and the next start removes it
    assert not [p for p in (tmp_path / "killed" / "checkpoints").iterdir() if "tmp" in p.name]
    resumed = train(config(tmp_path / "killed", *RESUME_ARGS), resume=True)
    straight = straight_run
    a, _ = final_params(straight, like_state(straight))
    b, _ = final_params(resumed, like_state(straight))
    for x, y in zip(jax.tree.leaves((a.policy, a.critic)), jax.tree.leaves((b.policy, b.critic))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
