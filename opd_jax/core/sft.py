"""Supervised warm start: token-mean cross-entropy on the response tokens, one pure step."""

from __future__ import annotations

import jax

from opd_jax.core.batch import RolloutBatch
from opd_jax.core.forward import sequence_logprobs
from opd_jax.core.losses import aggregate
from opd_jax.core.state import PolicyState
from opd_jax.core.update import apply_update


def sft_step(state: PolicyState, batch: RolloutBatch) -> tuple[PolicyState, dict[str, jax.Array]]:
    """loss = −Σ m_t · log π(tokens_t | tokens_<t) / Σ m_t over the response mask; one update,
    skipped (and counted in sft/skipped_nonfinite) when a gradient is not finite.
    (batch.logp_infer and batch.rewards are not used.)"""
    def loss_fn(params):
        logp, _ = sequence_logprobs(state.graphdef, params, batch, unroll=True)
        loss, _, count = aggregate(-logp, batch.response_mask, "token-mean")
        return loss, count

    (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    params, opt, metrics = apply_update(state.tx, state.params, state.opt, grads)
    return state.replace(step=state.step + 1, params=params, opt=opt), {
        "sft/loss": loss, "sft/tokens": count, **{f"sft/{k}": v for k, v in metrics.items()}}
