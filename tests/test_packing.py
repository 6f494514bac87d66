"""Packed forwards (core.packing) against the padded ones they replace: the plan (every
trajectory in one row, no overlap, strided groups), no attention across segments (hypothesis),
and the same log-probs, entropies, values, losses and updates for PPO (dense and MoE with routing
replay), OPD and SFT on ragged batches."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from ppo_setup import STEP_CONFIG, TINY, TINY_MOE, assert_updates_close, make_state, rollout_batch, scored_batch
from test_opd_step import distill_batch, setup

from opd_jax.core import OPDConfig, PolicyState, UpdateConfig, ppo_step, score_batch, sequence_logprobs, sequence_values, sft_step
from opd_jax.core.batch import BatchError
from opd_jax.core.opd_step import opd_step
from opd_jax.core.packing import pack_batch, plan_packing
from opd_jax.models import Decoder


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=4, max_size=16), groups=st.sampled_from([1, 2, 4]))
def test_the_plan_puts_every_trajectory_in_one_row_of_its_group_without_overlap(lengths, groups):
    lengths = lengths[:len(lengths) // groups * groups]
    pack_row, offset, rows = plan_packing(np.asarray(lengths), groups, 12)
    B = len(lengths)
    assert rows <= B // groups
    used = {}
    for b, n in enumerate(lengths):
        row = b % groups + pack_row[b] * groups  # the packed row, as core.packing lays it out
        assert 0 <= pack_row[b] < rows and offset[b] >= 0 and offset[b] + n <= 12
        for col in range(offset[b], offset[b] + n):
            assert (row, col) not in used, "two trajectories share a packed token"
            used[(row, col)] = b
    assert sum(lengths) == len(used)


@settings(max_examples=12, deadline=None)
@given(cuts=st.lists(st.integers(1, 7), min_size=2, max_size=4), seed=st.integers(0, 10_000))
def test_no_attention_crosses_a_segment(cuts, seed):
    """Segments laid end to end in one row: a segment's outputs are the same whatever the other
    segments hold, and equal to that segment run alone."""
    model = Decoder(TINY, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(seed)
    L = 32
    segment = np.zeros(L, np.int32)
    positions = np.zeros(L, np.int32)
    start = 0
    for i, n in enumerate(cuts):
        segment[start:start + n], positions[start:start + n] = i + 1, np.arange(n)
        start += n
    tokens = rng.integers(1, TINY.vocab_size, (2, L)).astype(np.int32)
    keep = segment == 1
    tokens[1, keep] = tokens[0, keep]  # row 1: segment 1 as in row 0, every other token changed
    seg = jnp.asarray(np.stack([segment, segment]))
    out = model(jnp.asarray(tokens), positions=jnp.asarray(np.stack([positions, positions])),
                attention_mask=seg > 0, segment_ids=seg)
    np.testing.assert_allclose(out[0, keep], out[1, keep], atol=1e-5)
    alone = model(jnp.asarray(tokens[:1, keep]))
    np.testing.assert_allclose(out[0, keep], alone[0], atol=1e-5)


def test_packing_refuses_padding_before_real_tokens():
    batch = rollout_batch(0)
    left = batch.replace(attention_mask=batch.attention_mask[:, ::-1])
    with pytest.raises(BatchError, match="real tokens first"):
        pack_batch(left, groups=2)


@pytest.mark.parametrize("groups", [1, 2])
def test_packed_forwards_equal_padded_ones(groups):
    state = make_state(optax.sgd(0.1), optax.sgd(0.1))
    padded = rollout_batch(3, B=16, T=12)
    packed = pack_batch(padded, groups=groups)
    assert packed.packing[1] < 16 // groups  # fewer rows than the padded batch
    for batch in (padded, packed):
        logp, entropy = sequence_logprobs(state.policy_def, state.policy, batch, with_entropy=True)
        values = sequence_values(state.critic_def, state.critic, batch)
        if batch is padded:
            ref = logp, entropy, values
    real = np.asarray(padded.attention_mask, bool)
    for got, want in zip((logp, entropy, values), ref):
        np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5)
    scored = [score_batch(state, b, microbatches=groups) for b in (padded, packed)]
    for field in ("logp_old", "old_values", "end_values"):
        np.testing.assert_allclose(getattr(scored[1], field), getattr(scored[0], field), atol=2e-5, err_msg=field)


def moe_routing(batch, seed=0):
    """An engine's expert ids for every real token of the MoE layer (2 of 4 experts), -1 elsewhere."""
    B, T = batch.tokens.shape
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(4)[:2] for _ in range(B * T)]).reshape(B, T, 1, 2)
    ids[~np.asarray(batch.attention_mask, bool)] = -1
    return jnp.asarray(ids, jnp.int32)


@pytest.mark.parametrize("config", [TINY, TINY_MOE], ids=["dense", "moe_replay"])
def test_a_packed_ppo_step_equals_the_padded_one(config):
    """The same scored batch, padded and packed into 4 groups (2 mini-batches × 2 micro-batches):
    the same metrics and the same updated policy and critic."""
    tx = optax.adam(1e-2)
    state = make_state(tx, tx, config=config)
    padded = scored_batch(state, seed=5)
    ppo = dataclasses.replace(STEP_CONFIG, update=UpdateConfig(minibatches=2, microbatches=2))
    if config.moe is not None:
        padded = padded.replace(routing=moe_routing(padded))
        ppo = dataclasses.replace(ppo, routing_replay="r3")
    packed = pack_batch(padded, groups=4)
    new_padded, m_padded = jax.jit(lambda s, b: ppo_step(s, b, config=ppo))(state, padded)
    new_packed, m_packed = jax.jit(lambda s, b: ppo_step(s, b, config=ppo))(state, packed)
    for key in m_padded:
        np.testing.assert_allclose(m_packed[key], m_padded[key], rtol=1e-3, atol=1e-5, err_msg=key)
    assert_updates_close(new_packed.policy, new_padded.policy, state.policy)
    assert_updates_close(new_packed.critic, new_padded.critic, state.critic)


def test_packed_opd_and_sft_steps_equal_padded_ones():
    tx = optax.adam(1e-2)
    state, batch, models, index = setup(tx)
    config = OPDConfig()
    steps = []
    for b in (batch, pack_batch(batch, groups=2)):
        distill = distill_batch(b, models, index, config.loss, config.top_k)
        steps.append(jax.jit(lambda s, d: opd_step(s, d, config=config, num_teachers=2, temperature=0.7))(state, distill))
    for key in steps[0][1]:
        np.testing.assert_allclose(steps[1][1][key], steps[0][1][key], rtol=1e-3, atol=1e-5, err_msg=key)
    assert_updates_close(steps[1][0].params, steps[0][0].params, state.params)

    sft = PolicyState.create(Decoder(TINY, rngs=nnx.Rngs(4)), tx)
    padded = rollout_batch(7)
    (a, ma), (b, mb) = (jax.jit(sft_step)(sft, x) for x in (padded, pack_batch(padded, groups=1)))
    np.testing.assert_allclose(mb["sft/loss"], ma["sft/loss"], rtol=1e-5)
    assert_updates_close(b.params, a.params, sft.params)


def test_auto_packs_a_batch_only_when_that_saves_rows():
    """update.pack="auto" (the default): a ragged batch is packed (fewer rows); a batch whose
    trajectories all fill their rows stays padded (packing would save nothing); False never packs,
    True always does; the groups keep the step's mini- x micro-batches and the data shards whole."""
    from opd_jax.train.batching import packed_for, packed_rows

    ragged = rollout_batch(3, B=16, T=12)
    full = ragged.replace(attention_mask=jnp.ones_like(ragged.attention_mask))
    update = UpdateConfig(minibatches=2)
    auto = packed_for(ragged, update, shards=2)
    assert auto.packing is not None and auto.packing[0] == 16 // 2 and packed_rows(auto) < 16
    assert packed_for(full, update, shards=2).packing is None
    assert packed_for(ragged, dataclasses.replace(update, pack=False), shards=2).packing is None
    forced = packed_for(full, dataclasses.replace(update, pack=True), shards=4)
    assert forced.packing[0] == 16 // 4 and packed_rows(forced) == 16
