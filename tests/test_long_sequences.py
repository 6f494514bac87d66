"""Long sequences in bounded memory (docs/long_sequences.md): the blockwise attention equals the
dense one, values and gradients, under padding, holes and packed segments; log-probs taken chunk by
chunk through the LM head equal the whole-logits ones; and a PPO step with the blockwise attention,
chunked log-probs and each rematerialisation policy equals the plain step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from ppo_setup import STEP_CONFIG, TINY, assert_updates_close, make_state, scored_batch, tiny_models

from opd_jax.core import PPOState, ppo_step
from opd_jax.core.distributions import chunked_token_logprobs, token_logprobs
from opd_jax.core.packing import pack_batch
from opd_jax.models.attention import AttentionMask, blockwise_attention, dense_attention
from opd_jax.models.execution import Execution


def _reference(q, k, v, allowed):
    """softmax(q·kᵀ/√d) over the allowed keys, in NumPy (grouped queries: head i reads kv head i // g)."""
    B, T, n, d = q.shape
    g = n // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("btnd,bsnd->bnts", q, k) / np.sqrt(d)
    s = np.where(allowed[:, None], s, -np.inf)
    top = np.max(s, -1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(top), top, 0.0))  # a query with no key: all zeros, never compared
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-30)
    return np.einsum("bnts,bsnd->btnd", p, v)


@pytest.mark.parametrize("blocks", [(8, 16), (16, 8), (64, 64)], ids=["bq8-bk16", "bq16-bk8", "one-block"])
def test_blockwise_attention_equals_dense_attention_values_and_gradients(blocks):
    """37 tokens (no multiple of a block), 4 query heads over 2 key heads; row 0 left-padded, row 1
    with a hole and right padding, then packed into two segments: the outputs of every query that
    attends anything equal NumPy's softmax and the dense form's to 1e-5, and so do the gradients
    of a weighted sum of them with respect to q, k and v."""
    rng = np.random.default_rng(0)
    B, T, n, kv, d = 2, 37, 4, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, h, d)), jnp.float32) for h in (n, kv, kv))
    valid = np.ones((B, T), bool)
    valid[0, :5] = False
    valid[1, 10:13] = False
    valid[1, -6:] = False
    segments = np.where(valid, np.where(np.arange(T) < 20, 1, 2), 0).astype(np.int32)
    for seg in (None, jnp.asarray(segments)):
        mask = AttentionMask.causal(jnp.asarray(valid), seg)
        allowed = np.asarray(mask.dense())
        if seg is not None:  # no key of another segment
            assert not allowed[1, 25, :20].any() and allowed[1, 25, 20:26].all()
        rows = allowed.any(-1)
        out = blockwise_attention(q, k, v, mask, block_q=blocks[0], block_k=blocks[1])
        ref = _reference(*map(np.asarray, (q, k, v)), allowed)
        np.testing.assert_allclose(np.asarray(out)[rows], ref[rows], atol=1e-5)
        np.testing.assert_array_equal(np.asarray(out)[~rows], 0.0)
        w = jnp.asarray(rng.normal(size=(B, T, n, d)), jnp.float32) * rows[..., None, None]
        dense = jax.grad(lambda *a: jnp.sum(dense_attention(*a, jnp.asarray(allowed)) * w), argnums=(0, 1, 2))(q, k, v)
        block = jax.grad(lambda *a: jnp.sum(blockwise_attention(*a, mask, block_q=blocks[0], block_k=blocks[1]) * w),
                         argnums=(0, 1, 2))(q, k, v)
        for name, a, b in zip("qkv", dense, block):
            np.testing.assert_allclose(b, a, atol=1e-5, err_msg=name)


def test_chunked_log_probs_equal_the_whole_logits_ones_and_so_do_their_gradients():
    """23 tokens in chunks of 5 (the last one short): log-probs and entropies as token_logprobs of
    the whole logits gives them, and the gradients of a loss on them with respect to the hidden
    states and the head's weights."""
    rng = np.random.default_rng(1)
    B, T, H, V = 3, 23, 16, 40
    hidden = jnp.asarray(rng.normal(size=(B, T, H)), jnp.float32)
    head_w = jnp.asarray(rng.normal(size=(H, V)) * 0.5, jnp.float32)
    tokens = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(B, T)), jnp.float32)

    def loss(hidden, head_w, chunk):
        head = lambda h: (h @ head_w).astype(jnp.float32)  # noqa: E731
        if chunk is None:
            logp, entropy = token_logprobs(head(hidden), tokens, with_entropy=True)
        else:
            logp, entropy = chunked_token_logprobs(hidden, head, tokens, chunk=chunk, with_entropy=True)
        return jnp.sum(logp * weights) + 0.1 * jnp.sum(entropy * weights), (logp, entropy)

    (whole, (logp, entropy)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(hidden, head_w, None)
    (chunked, (logp_c, entropy_c)), grads_c = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(hidden, head_w, 5)
    np.testing.assert_allclose(logp_c, logp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(entropy_c, entropy, rtol=1e-5, atol=1e-6)
    assert logp_c.shape == (B, T) and np.all(np.asarray(logp_c)[:, 0] == 0)
    for a, b in zip(grads, grads_c):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss, packed", [("full", False), ("top_k", True)], ids=["full", "top_k-packed"])
def test_an_opd_step_and_its_teachers_scores_in_chunks_equal_the_whole_ones(loss, packed):
    """Two teachers' scores (the whole vocabulary, or its top 8) and the OPD step's divergences to
    them (reverse KL, 2 teachers, IcePop), taken 5 positions at a time through the LM head (the
    student's batch packed into 4 rows for top-k): the same scores, metrics and update as in one
    piece."""
    from test_opd_step import RUN, distill_batch, setup

    from opd_jax.core import OPDConfig, PolicyState, opd_step

    state, batch, teachers, index = setup(optax.sgd(0.05))
    whole = distill_batch(batch, teachers, index, loss)
    in_chunks = Execution(logits_chunk=5)
    chunked = distill_batch(batch, [t.set_execution(in_chunks) for t in teachers], index, loss)
    for name in ("logp_teacher", "teacher_logprobs", "teacher_ids"):
        if getattr(whole, name) is not None:
            np.testing.assert_allclose(getattr(chunked, name), getattr(whole, name), rtol=1e-5, atol=1e-6, err_msg=name)
    if packed:
        whole = whole.replace(rollout=pack_batch(whole.rollout, groups=4))
    step = jax.jit(functools.partial(opd_step, config=OPDConfig(loss=loss, top_k=8), **RUN))
    plain, m_plain = step(state, whole)
    student = nnx.merge(state.graphdef, state.params).set_execution(in_chunks)
    new, m_new = step(PolicyState.create(student, state.tx), whole)
    for key in m_plain:
        np.testing.assert_allclose(m_new[key], m_plain[key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert_updates_close(new.params, plain.params, state.params, rtol=1e-4)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_ppo_step_computed_for_long_sequences_equals_the_plain_one(packed):
    """The same scored batch (ragged responses; padded, or packed into 4 rows), the same PPO step
    (2 mini-batches, critic, IcePop): with the policy's and critic's forward attending in blocks of
    4 tokens, taking log-probs 5 tokens at a time and keeping only the layers' matmuls for the
    backward (remat dots), or (padded) rematerialising every layer whole: the same metrics and
    updates as the plain step."""
    tx = optax.adam(1e-2)
    state = make_state(tx, tx, config=TINY)
    batch = scored_batch(state, seed=5)
    if packed:
        batch = pack_batch(batch, groups=4)
    step = jax.jit(lambda s, b: ppo_step(s, b, config=STEP_CONFIG))
    plain, m_plain = step(state, batch)
    executions = [Execution(attention="blockwise", attention_block=4, logits_chunk=5, remat="dots")]
    if not packed:
        executions.append(Execution(remat="full"))
    for execution in executions:
        policy, critic = tiny_models(TINY)
        policy.set_execution(execution)
        critic.backbone.execution = execution
        new, m_new = step(PPOState.create(policy, critic, tx, tx), batch)
        for key in m_plain:
            np.testing.assert_allclose(m_new[key], m_plain[key], rtol=1e-4, atol=1e-6, err_msg=f"{execution}: {key}")
        assert_updates_close(new.policy, plain.policy, state.policy, rtol=1e-4)
        assert_updates_close(new.critic, plain.critic, state.critic, rtol=1e-4)


def test_offloading_rematerialisation_on_the_cpu_is_one_line_before_the_run_starts(tmp_path):
    """model.remat: offload needs an accelerator's pinned host memory: on the CPU the run is refused
    in one line (exit 2) before its run directory is made."""
    from test_cli_train import QUICKSTART, run_cli

    result = run_cli(["train", QUICKSTART, "model.remat=offload", f"logging.run_dir={tmp_path / 'run'}"])
    assert result.exit_code == 2, result.output
    assert "model.remat: offload moves saved activations to an accelerator's pinned host memory" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()


@pytest.mark.parametrize("topk", [4, 64], ids=["dsa-top4", "every-key"])
def test_glm5s_latent_attention_attends_in_blocks_from_the_o_t_mask_as_its_engine_does(topk):
    """GLM-5 (MLA, experts; DSA keeping 4 keys per query, or every key: MLA through the blockwise
    attention) over 40 tokens, row 1 left-padded: the training forward (blocks of 8; DSA's chunks
    built from the O(T) mask) gives the logits of the engine's prefill through its [B, T, slots]
    cache mask, the path that never saw an AttentionMask, and the dense forward's; attending every
    key, the blockwise forward's gradients equal the dense one's; and a row packing two sequences
    gives each the logits it has alone."""
    import dataclasses

    from test_glm5 import GLM5, peaked

    from opd_jax.models import Decoder, KVCache

    config = dataclasses.replace(GLM5, dsa=dataclasses.replace(GLM5.dsa, index_topk=topk))
    model = peaked(Decoder(config, rngs=nnx.Rngs(3)))
    rng = np.random.default_rng(4)
    B, T = 2, 40
    tokens = jnp.asarray(rng.integers(0, GLM5.vocab_size, (B, T)), jnp.int32)
    mask = np.ones((B, T), np.int32)
    mask[1, :6] = 0
    positions = jnp.asarray(np.maximum(np.cumsum(mask, 1) - 1, 0), jnp.int32)
    mask = jnp.asarray(mask)

    def logits_with(execution, params=None):
        m = Decoder(config, rngs=nnx.Rngs(0)).set_execution(execution)
        nnx.update(m, params if params is not None else nnx.state(model, nnx.Param))
        return m(tokens, positions=positions, attention_mask=mask)

    blockwise = Execution(attention="blockwise", attention_block=8)
    hidden = model.backbone.extend(tokens, KVCache.empty(config, B, 48, jnp.float32), positions=positions,
                                   attention_mask=mask)[0]
    engine = np.asarray(model.logits(hidden))
    trainer = np.asarray(logits_with(blockwise))
    real = np.asarray(mask, bool)
    np.testing.assert_allclose(trainer[real], engine[real], atol=1e-4, rtol=1e-4)
    dense = np.asarray(logits_with(Execution(attention="dense")))
    np.testing.assert_allclose(trainer[real], dense[real], atol=1e-5, rtol=1e-5)
    # the tokens split over 8 sequence shards (context parallelism): the same logits
    from opd_jax.parallel import MeshConfig, make_mesh, under_mesh
    split = under_mesh(jax.jit(lambda p: logits_with(blockwise, p)), make_mesh(MeshConfig(data=1, sequence=8)))
    np.testing.assert_allclose(np.asarray(split(nnx.state(model, nnx.Param)))[real], trainer[real], atol=1e-5, rtol=1e-5)

    weights = jnp.asarray(rng.normal(size=trainer.shape), jnp.float32) * mask[..., None]
    params = nnx.state(model, nnx.Param)
    grads = [] if topk < T else [jax.grad(lambda p, e=e: jnp.sum(logits_with(e, p) * weights))(params)
             for e in (blockwise, Execution(attention="dense"))]
    for got, want in zip(*(jax.tree.leaves(g) for g in grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)

    # one row packing the first 15 and the last 25 tokens of row 0, each from position 0
    segments = jnp.asarray([[1] * 15 + [2] * 25], jnp.int32)
    packed_positions = jnp.asarray([list(range(15)) + list(range(25))], jnp.int32)
    m = Decoder(config, rngs=nnx.Rngs(0)).set_execution(blockwise)
    nnx.update(m, params)
    packed = np.asarray(m(tokens[:1], positions=packed_positions, segment_ids=segments))
    for lo, hi in ((0, 15), (15, 40)):
        alone = np.asarray(m(tokens[:1, lo:hi]))
        np.testing.assert_allclose(packed[0, lo:hi], alone[0], atol=1e-5, rtol=1e-5)
