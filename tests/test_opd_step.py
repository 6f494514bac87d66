"""The OPD step against reference updates written from the formulas (sampled-token reverse KL
through the clipped IcePop surrogate, MOPD reward mixing, full-vocabulary and top-k reverse KL,
forward KL and JSD(β), a divergence per teacher),
the teachers' scoring pass against a plain forward, micro-batching, and the masked-token
property."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from ppo_setup import TINY, assert_updates_close, rollout_batch

from opd_jax.core import (
    PER_TEACHER_KL,
    DistillBatch,
    MismatchCorrection,
    OPDConfig,
    PolicyState,
    SurrogateConfig,
    UpdateConfig,
    opd_step,
    score_student,
    teacher_scores,
)
from opd_jax.models import Decoder

T_SAMPLE = 0.7  # the student's sampling temperature: student and teachers score at it


def host(x):
    return np.asarray(x, np.float64)


def setup(tx, seed=0, teachers=2, B=16):
    """A student state, `teachers` teachers that differ from it and from each other, and a
    scored ragged batch whose rows are routed to them in turn; engine log-probs are the student's
    plus noise, so IcePop masks some tokens."""
    student = Decoder(TINY, rngs=nnx.Rngs(seed))
    models = [Decoder(TINY, rngs=nnx.Rngs(seed + 10 + k)) for k in range(teachers)]
    state = PolicyState.create(student, tx)
    batch = score_student(state, rollout_batch(seed, B=B), temperature=T_SAMPLE)
    noise = np.random.default_rng(seed + 1).normal(scale=0.4, size=batch.tokens.shape).astype(np.float32)
    batch = batch.replace(logp_infer=jnp.minimum(batch.logp_old + noise, 0.0) * batch.response_mask,
                          rewards=jnp.asarray(np.random.default_rng(seed + 2).integers(0, 2, B).astype(np.float32)))
    index = np.arange(B) % teachers
    return state, batch, models, index


@functools.partial(jax.jit, static_argnames=("graphdef", "loss", "top_k"))
def _teacher_scores(graphdef, params, batch, loss, top_k):
    return teacher_scores(graphdef, params, batch, loss=loss, top_k=top_k, temperature=T_SAMPLE)


def distill_batch(batch, models, index, loss, top_k=8):
    """Each row scored by its own teacher (every teacher scores every row; rows are picked)."""
    per = [_teacher_scores(*nnx.split(m, nnx.Param), batch, loss, top_k) for m in models]
    fields = {name: np.stack([host(p[name]) for p in per])[index, np.arange(len(index))] for name in per[0]}
    if "teacher_ids" in fields:
        fields["teacher_ids"] = fields["teacher_ids"].astype(np.int32)
    return DistillBatch(rollout=batch, teacher_index=jnp.asarray(index, jnp.int32),
                        **{k: jnp.asarray(v.astype(np.int32 if k == "teacher_ids" else np.float32))
                           for k, v in fields.items()})


def log_softmax(x):
    return x - jax.nn.logsumexp(x, axis=-1, keepdims=True)


def reference_divergence(ls, lt, kind, beta):
    kl = lambda lp, lq: jnp.sum(jnp.exp(lp) * (lp - lq), -1)  # noqa: E731
    if kind == "reverse_kl":
        return kl(ls, lt)
    if kind == "forward_kl":
        return kl(lt, ls)
    lm = jnp.log(beta * jnp.exp(lt) + (1 - beta) * jnp.exp(ls))  # jsd
    return beta * kl(lt, lm) + (1 - beta) * kl(ls, lm)


def reference_sgd_step(state, batch: DistillBatch, config: OPDConfig, lr, group_size=1, divergences=None):
    """One SGD step on the OPD objective, written from the formulas with plain jnp; divergences:
    each teacher's (default: config.divergence); batch.row_weights scale each row's distillation
    term; batch.off_policy rows (a teacher's samples) have weight 1 and no reward term."""
    r = batch.rollout
    m = r.response_mask
    lold, linf = r.logp_old, r.logp_infer
    k = jnp.exp(lold - linf)
    w = jnp.where((k >= 0.5) & (k <= 2.0), k, 0.0) * m  # IcePop, β = 2
    own = 1.0 if batch.off_policy is None else 1.0 - batch.off_policy[:, None]
    w = own * w + (1.0 - own) * m
    rewards = r.rewards.reshape(-1, group_size)
    group = ((rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-6)).reshape(-1)
    reward_adv = config.reward_alpha * group[:, None] * m * own
    balance = 1.0 if batch.row_weights is None else batch.row_weights[:, None]
    advantages = reward_adv + (balance * (batch.logp_teacher - lold) * m if config.loss == "sampled" else 0.0)
    positions = r.positions

    def objective(params):
        logits = nnx.merge(state.graphdef, params)(r.tokens, positions=positions, attention_mask=r.attention_mask)
        logits = logits / T_SAMPLE
        prev = log_softmax(logits[:, :-1])  # predicts tokens 1..T-1
        logp = jnp.pad(jnp.take_along_axis(prev, r.tokens[:, 1:, None], -1)[..., 0], ((0, 0), (1, 0)))
        ratio = jnp.exp(logp - lold)
        surrogate = -w * jnp.minimum(ratio * advantages, jnp.clip(ratio, 0.8, 1.28) * advantages)
        loss = jnp.sum(surrogate * m) / jnp.sum(m) if (config.loss == "sampled" or config.reward_alpha) else 0.0
        if config.loss != "sampled":
            ls = jnp.pad(prev, ((0, 0), (1, 0), (0, 0)))
            if config.loss == "full":
                lt = batch.teacher_logprobs
            else:  # both renormalised on the teacher's top-k tokens
                ls = jnp.take_along_axis(ls, batch.teacher_ids, -1)
                ls, lt = log_softmax(ls), log_softmax(batch.teacher_logprobs)
            kinds = divergences or (config.divergence,) * 2
            per_row = jnp.stack([reference_divergence(ls, lt, kinds[k], config.jsd_beta) for k in range(2)])
            kl = per_row[batch.teacher_index, jnp.arange(len(batch.teacher_index))]  # each row its teacher's kind
            loss = loss + jnp.sum(w * balance * kl * m) / jnp.sum(m)
        return loss

    grads = jax.jit(jax.grad(objective))(state.params)
    return jax.tree.map(lambda p, g: p - lr * g, state.params, grads)


# what the run passes to every step: two teachers, the engine's sampling temperature
RUN = {"num_teachers": 2, "temperature": T_SAMPLE}

VARIANTS = {  # config, samples per prompt, each teacher's divergence (None: the config's), balanced
    "sampled (GLM-5)": (OPDConfig(), 1, None, False),
    "sampled + reward (MOPD), balanced": (OPDConfig(reward_alpha=0.5), 4, None, True),
    "full vocabulary": (OPDConfig(loss="full"), 1, None, False),
    "top-k + reward": (OPDConfig(loss="top_k", top_k=8, reward_alpha=0.3), 4, None, False),
    "full forward KL, balanced": (OPDConfig(loss="full", divergence="forward_kl"), 1, None, True),
    "top-k JSD(0.3)": (OPDConfig(loss="top_k", top_k=8, divergence="jsd", jsd_beta=0.3), 1, None, False),
    "full, per teacher: forward KL, JSD(0.3)": (OPDConfig(loss="full", jsd_beta=0.3), 1, ("forward_kl", "jsd"), False),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_step_matches_reference_sgd_update(name):
    (config, group_size, divergences, balanced), lr = VARIANTS[name], 0.05
    state, batch, models, index = setup(optax.sgd(lr))
    distill = distill_batch(batch, models, index, config.loss, config.top_k)
    if balanced:  # teacher 1's rows weigh four times teacher 0's
        distill = distill.replace(row_weights=jnp.asarray(np.array([0.4, 1.6], np.float32)[index]))
    step = functools.partial(opd_step, config=config, group_size=group_size, divergences=divergences, **RUN)
    new, metrics = jax.jit(step)(state, distill)
    assert_updates_close(new.params, reference_sgd_step(state, distill, config, lr, group_size, divergences), state.params)
    assert int(new.step) == 1
    # the per-teacher reverse KL: mean of log π_old − log π_teacher over each teacher's tokens
    m, gap = host(batch.response_mask), host(batch.logp_old) - host(distill.logp_teacher)
    for k in range(2):
        rows = index == k
        np.testing.assert_allclose(float(metrics[PER_TEACHER_KL][k]), (gap[rows] * m[rows]).sum() / m[rows].sum(),
                                   rtol=1e-5)
    np.testing.assert_allclose(float(metrics["opd/reverse_kl"]), (gap * m).sum() / m.sum(), rtol=1e-5)
    if config.loss == "sampled" or config.reward_alpha:  # the first update: still θ_old, so r = 1 exactly
        np.testing.assert_allclose(float(metrics["student/ratio_mean"]), 1.0, atol=1e-6)
    else:
        assert "student/ratio_mean" not in metrics and float(metrics["student/distill_loss"]) > 0


@pytest.mark.parametrize("loss", ["full", "top_k"])
def test_teachers_samples_train_unweighted_and_without_reward(loss):
    """Rows flagged off_policy (a teacher's samples, GKD's mixture): their engine log-probs are the
    teacher's, far from the student's, so IcePop would drop most of their tokens; the step gives
    them weight 1 and no reward term, and the sampled reverse KL is reported over the student's
    own rows only."""
    config, lr = OPDConfig(loss=loss, top_k=8, reward_alpha=0.3), 0.05
    state, batch, models, index = setup(optax.sgd(lr))
    off = (np.arange(len(index)) // 4) % 2  # whole groups of 4: the second, fourth, ... are the teachers'
    far = batch.logp_infer - 2.0 * jnp.asarray(off[:, None], jnp.float32) * batch.response_mask
    distill = distill_batch(batch.replace(logp_infer=far), models, index, loss, 8).replace(
        off_policy=jnp.asarray(off, jnp.float32))
    step = functools.partial(opd_step, config=config, group_size=4, **RUN)
    new, metrics = jax.jit(step)(state, distill)
    assert_updates_close(new.params, reference_sgd_step(state, distill, config, lr, 4), state.params)
    m, gap = host(batch.response_mask), host(batch.logp_old) - host(distill.logp_teacher)
    own = (off == 0)[:, None] * m
    np.testing.assert_allclose(float(metrics["opd/reverse_kl"]), (gap * own).sum() / own.sum(), rtol=1e-5)
    for k in range(2):
        rows = (index == k)[:, None] * own
        np.testing.assert_allclose(float(metrics[PER_TEACHER_KL][k]), (gap * rows).sum() / rows.sum(), rtol=1e-5)
    assert float(metrics["opd/off_policy_rows"]) == off.sum()
    with pytest.raises(ValueError, match="off-policy rows need loss"):
        opd_step(state, distill.replace(teacher_logprobs=None, teacher_ids=None), config=OPDConfig(), **RUN)


def test_teacher_scores_match_a_plain_forward():
    state, batch, models, _ = setup(optax.sgd(0.1))
    teacher = models[0]
    logits = host(teacher(batch.tokens, attention_mask=batch.attention_mask)) / T_SAMPLE  # right padding
    logsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    tokens, m = np.asarray(batch.tokens), host(batch.response_mask)
    dist = np.zeros_like(logsm)
    dist[:, 1:] = logsm[:, :-1]
    expected = np.take_along_axis(dist, tokens[..., None], -1)[..., 0] * m
    graphdef, params = nnx.split(teacher, nnx.Param)
    full = teacher_scores(graphdef, params, batch, loss="full", temperature=T_SAMPLE, microbatches=4)
    np.testing.assert_allclose(host(full["logp_teacher"]), expected, atol=2e-5)
    np.testing.assert_allclose(host(full["teacher_logprobs"]), dist * m[..., None], atol=2e-5)
    top = teacher_scores(graphdef, params, batch, loss="top_k", top_k=5, temperature=T_SAMPLE)
    on = m > 0
    np.testing.assert_allclose(host(top["teacher_logprobs"])[on], -np.sort(-dist, -1)[..., :5][on], atol=2e-5)
    ids = np.asarray(top["teacher_ids"])[on]
    np.testing.assert_allclose(np.take_along_axis(dist[on], ids, -1), host(top["teacher_logprobs"])[on], atol=2e-5)


def test_micro_batches_and_mini_batches(loss="full"):
    """Micro-batch accumulation is the machinery PPO shares (tested there too); here with the KL loss."""
    tx = optax.adam(1e-2)
    state, batch, models, index = setup(tx)
    distill = distill_batch(batch, models, index, loss)
    base = OPDConfig(loss=loss, update=UpdateConfig(epochs=2, minibatches=2),
                     surrogate=SurrogateConfig(loss_agg="seq-mean-token-mean"))
    one, m1 = jax.jit(functools.partial(opd_step, config=base, **RUN))(state, distill)
    micro = dataclasses.replace(base, update=UpdateConfig(epochs=2, minibatches=2, microbatches=4))
    many, m4 = jax.jit(functools.partial(opd_step, config=micro, **RUN))(state, distill)
    assert_updates_close(many.params, one.params, state.params, rtol=2e-3)
    np.testing.assert_allclose(float(m4["student/loss"]), float(m1["student/loss"]), rtol=1e-4)


@functools.cache
def _masking_case(loss):
    state, batch, models, index = setup(optax.sgd(0.1))
    step = jax.jit(functools.partial(opd_step, config=OPDConfig(loss=loss), **RUN))
    return state, batch, distill_batch(batch, models, index, loss), step


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16), loss=st.sampled_from(["sampled", "full"]))
def test_masked_tokens_get_no_gradient(seed, loss):
    """Whatever the teachers say about tokens outside the response mask (prompt, padding), the
    update is the same."""
    state, batch, distill, step = _masking_case(loss)
    rng = np.random.default_rng(seed)
    off = 1.0 - host(batch.response_mask)
    scrambled = distill.replace(logp_teacher=distill.logp_teacher - jnp.asarray(off * rng.exponential(5, off.shape),
                                                                                jnp.float32))
    if loss == "full":
        junk = rng.normal(scale=3, size=distill.teacher_logprobs.shape)
        scrambled = scrambled.replace(teacher_logprobs=distill.teacher_logprobs
                                      + jnp.asarray(off[..., None] * junk, jnp.float32))
    a, _ = step(state, distill)
    b, _ = step(state, scrambled)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_full_reverse_kl_moves_the_student_to_its_teachers():
    """Repeated steps on one batch shrink each row's KL to its own teacher (not a shared one)."""
    state, batch, models, index = setup(optax.adam(3e-3))
    distill = distill_batch(batch, models, index, "full")
    config = OPDConfig(loss="full", surrogate=SurrogateConfig(mismatch=MismatchCorrection("none")))
    step = jax.jit(functools.partial(opd_step, config=config, **RUN))
    first = None
    for _ in range(30):
        state, metrics = step(state, distill)
        first = first if first is not None else float(metrics["student/distill_loss"])
    last = float(metrics["student/distill_loss"])
    assert last < 0.3 * first, (first, last)


def test_missing_inputs_are_named():
    state, batch, models, index = setup(optax.sgd(0.1))
    distill = distill_batch(batch, models, index, "sampled")
    with pytest.raises(ValueError, match="needs batch.teacher_logprobs"):
        opd_step(state, distill, config=OPDConfig(loss="full"))
    with pytest.raises(ValueError, match="score the student with policy_logprobs first"):
        opd_step(state, distill.replace(rollout=batch.replace(logp_old=None)), config=OPDConfig())
    with pytest.raises(ValueError, match="unknown OPD loss 'forward'"):
        OPDConfig(loss="forward")
    with pytest.raises(ValueError, match="divergence 'forward_kl' needs the teacher's distribution: use loss 'full'"):
        OPDConfig(divergence="forward_kl")
    with pytest.raises(ValueError, match=r"one divergence per teacher \(2\)"):
        opd_step(state, distill, config=OPDConfig(loss="full"), num_teachers=2, divergences=("forward_kl",))
    with pytest.raises(ValueError, match="not a whole number of groups of 3"):
        opd_step(state, distill, config=OPDConfig(reward_alpha=1.0), group_size=3)


def test_routing_replay_reaches_the_students_scoring_and_its_update():
    """A MoE student whose engine routes elsewhere (another selection bias): with routing_replay r3
    the student's θ_old log-probs are the engine's (its routing replayed) and the OPD step equals
    one SGD step on the objective with the engine's experts forced, written from the formulas."""
    import dataclasses as dc

    from ppo_setup import TINY_MOE

    from opd_jax.sampling import Sampler
    from opd_jax.train.batching import rollouts_to_batch
    from rollout_bridge.records import SamplingParams

    lr = 0.05
    student = Decoder(dc.replace(TINY_MOE, moe=dc.replace(TINY_MOE.moe, n_group=1, topk_group=1)), rngs=nnx.Rngs(5))
    graphdef, params = nnx.split(student)
    engine_params = jax.tree.map(jnp.copy, params)
    bias = engine_params["backbone"]["layers"]["router_bias"]
    bias[...] = jnp.asarray(np.random.default_rng(0).normal(scale=3.0, size=bias[...].shape), jnp.float32)
    rollouts = Sampler(nnx.merge(graphdef, engine_params), max_cache_len=32).generate(
        [[5, 9, 2, 7], [11, 3, 8], [4, 4, 1], [2, 8, 6, 1]], SamplingParams(max_new_tokens=5, temperature=T_SAMPLE),
        jax.random.key(1))
    batch = rollouts_to_batch(rollouts, np.zeros(4), pad_id=0)
    state = PolicyState.create(student, optax.sgd(lr))
    replayed = score_student(state, batch, temperature=T_SAMPLE, routing_replay=True)
    own = score_student(state, batch, temperature=T_SAMPLE)
    m = host(batch.response_mask)
    np.testing.assert_allclose(host(replayed.logp_old) * m, host(batch.logp_infer) * m, atol=1e-4)
    assert np.abs(host(own.logp_old) - host(batch.logp_infer))[m > 0].max() > 1e-3
    teacher = Decoder(student.config, rngs=nnx.Rngs(9))
    index = np.zeros(4, np.int64)
    distill = distill_batch(replayed, [teacher], index, "sampled")
    config = OPDConfig(routing_replay="r3")
    new, _ = jax.jit(functools.partial(opd_step, config=config, num_teachers=1, temperature=T_SAMPLE))(state, distill)
    r = distill.rollout
    expected = sgd_step_on_sampled_objective(
        state, distill, lr, T_SAMPLE,
        lambda model: model(r.tokens, positions=r.positions, attention_mask=r.attention_mask, routing=r.routing))
    assert_updates_close(new.params, expected, state.params)


def sgd_step_on_sampled_objective(state, distill, lr, temperature, forward):
    """The parameters after one SGD step (rate lr) on OPD's sampled-token objective, from the
    formulas: advantage A = log π_teacher − log π_old, IcePop weight w = k on [0.5, 2] (k = π_old /
    π_engine), −w · min(ρA, clip(ρ, 0.8, 1.28)A) averaged over the response tokens; `forward`
    (a model -> its logits on the batch) is how the student runs."""
    r = distill.rollout
    adv = (distill.logp_teacher - r.logp_old) * r.response_mask
    k = jnp.exp(r.logp_old - r.logp_infer)
    w = jnp.where((k >= 0.5) & (k <= 2.0), k, 0.0) * r.response_mask

    def objective(p):
        prev = log_softmax(forward(nnx.merge(state.graphdef, p))[:, :-1] / temperature)
        logp = jnp.pad(jnp.take_along_axis(prev, r.tokens[:, 1:, None], -1)[..., 0], ((0, 0), (1, 0)))
        ratio = jnp.exp(logp - r.logp_old)
        per = -w * jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.28) * adv)
        return jnp.sum(per * r.response_mask) / jnp.sum(r.response_mask)
    return jax.tree.map(lambda p, g: p - lr * g, state.params, jax.grad(objective)(state.params))
