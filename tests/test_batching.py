"""Rollouts into the trainer's batch: alignment of tokens and engine log-probs, truncation
policies, empty responses, and rewards from the verifiers (NaN rewards named)."""

import math

import numpy as np
import pytest

from opd_jax.core import validate_batch
from opd_jax.data import Example
from opd_jax.models.char_tokenizer import char_tokenizer
from opd_jax.rewards import RewardError
from opd_jax.train.batching import rollout_rewards, rollouts_to_batch
from rollout_bridge.records import Rollout


def rollout(prompt, output, reason="stop"):
    return Rollout(prompt_ids=tuple(prompt), output_ids=tuple(output),
                   output_logprobs=tuple(-0.1 * (i + 1) for i in range(len(output))), finish_reason=reason,
                   weight_version=0)


def test_tokens_masks_and_logprobs_line_up():
    rollouts = [rollout([5, 6, 7], [8, 9, 1]), rollout([5], [], "stop"), rollout([4, 4], [3, 3, 3, 3], "length")]
    for mode, penalty in (("keep", 0.0), ("mask", 0.0), ("penalize", -1.0)):
        batch = rollouts_to_batch(rollouts, np.array([1.0, 0.0, 1.0]), pad_id=0, truncated=mode,
                                  truncation_penalty=penalty)
        validate_batch(batch)
        tokens, resp, logp = (np.asarray(x) for x in (batch.tokens, batch.response_mask, batch.logp_infer))
        assert tokens.shape == (3, 32)
        np.testing.assert_array_equal(tokens[0, :7], [5, 6, 7, 8, 9, 1, 0])
        np.testing.assert_array_equal(resp[0, :7], [0, 0, 0, 1, 1, 1, 0])
        np.testing.assert_allclose(logp[0, 3:6], [-0.1, -0.2, -0.3])
        assert resp[1].sum() == 0  # empty response: nothing to train on
        np.testing.assert_array_equal(np.asarray(batch.attention_mask)[2, :7], [1, 1, 1, 1, 1, 1, 0])
        assert resp[2].sum() == (0 if mode == "mask" else 4)
        assert float(batch.rewards[2]) == (-1.0 if mode == "penalize" else 1.0)
    with pytest.raises(ValueError, match="truncated must be"):
        rollouts_to_batch(rollouts, np.zeros(3), pad_id=0, truncated="drop")


def test_rewards_from_verifiers_and_user_functions():
    tok = char_tokenizer()
    eos = tok.eos_token_id
    examples = [Example("2+3=", "5", "addition"), Example("q", "12", "my_jsonl"), Example("q", "yes", "other")]
    outs = [rollout([1], [*tok.encode("5"), eos]), rollout([1], tok.encode("it is 12")), rollout([1], tok.encode("no"))]
    np.testing.assert_array_equal(rollout_rewards(outs, examples, tok), [1.0, 1.0, 0.0])
    lengths = rollout_rewards(outs, examples, tok, reward_fn=lambda p, r, a, d: float(len(r)))
    np.testing.assert_array_equal(lengths, [1.0, 8.0, 2.0])
    with pytest.raises(RewardError, match=r"reward of sample 1 \(domain 'my_jsonl'"):
        rollout_rewards(outs, examples, tok, reward_fn=lambda p, r, a, d: math.nan if d == "my_jsonl" else 1.0)


def test_trainer_rescoring_matches_the_engine_at_its_temperature():
    """Engine samples at T = 0.7 in float32; the trainer's θ_old log-probs of the same tokens at
    the same temperature agree with the engine's, and at T = 1 they clearly do not."""
    import jax
    import optax
    from ppo_setup import make_state

    from opd_jax.core import score_batch
    from opd_jax.sampling import Sampler
    from rollout_bridge.records import SamplingParams

    state = make_state(optax.sgd(0.1), optax.sgd(0.1))
    engine = Sampler(state.policy_model(), max_cache_len=64)
    prompts = [[3, 4, 5], [7, 8], [9, 10, 11, 12]]
    rollouts = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.7), jax.random.key(0))
    batch = rollouts_to_batch(rollouts, np.zeros(3), pad_id=0)
    m = np.asarray(batch.response_mask) > 0
    same = score_batch(state, batch, temperature=0.7)
    np.testing.assert_allclose(np.asarray(same.logp_old)[m], np.asarray(batch.logp_infer)[m], atol=2e-4)
    other = score_batch(state, batch, temperature=1.0)
    assert np.abs(np.asarray(other.logp_old)[m] - np.asarray(batch.logp_infer)[m]).mean() > 0.01  # 100x the tolerance above
