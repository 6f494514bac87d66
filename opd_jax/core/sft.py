"""Supervised warm start: token-mean cross-entropy on the response tokens, one pure step."""

from __future__ import annotations

import jax
from flax import nnx

from opd_jax.core.batch import RolloutBatch
from opd_jax.core.forward import sequence_logprobs, training_key
from opd_jax.core.losses import aggregate
from opd_jax.core.metrics import unwrap
from opd_jax.core.optim import loss_scale_of
from opd_jax.core.router import router_losses
from opd_jax.core.state import PolicyState
from opd_jax.core.update import accumulate_grads, apply_update


def sft_step(state: PolicyState, batch: RolloutBatch, *, router_balance_coef: float = 0.0
             ) -> tuple[PolicyState, dict[str, jax.Array]]:
    """loss = −Σ m_t · log π(tokens_t | tokens_<t) / Σ m_t over the response mask
    (+ router_balance_coef · the load-balancing loss of a MoE policy's routers, `router_losses`);
    one update, skipped (and counted in sft/skipped_nonfinite) when a gradient is not finite.
    (batch.logp_infer and batch.rewards are not used.)"""
    moe_layers = nnx.merge(state.graphdef, state.params).config.moe_layers

    def loss_fn(params):
        logp, _, router = sequence_logprobs(state.graphdef, params, batch, unroll=True, with_router=True,
                                            dropout_key=training_key(state.step, batch.tokens))
        loss, _, count = aggregate(-logp, batch.response_mask, "token-mean")
        metrics = {"loss": loss, "tokens": count}
        if router is not None:
            aux, router_metrics = router_losses(router, router_balance_coef, 0.0, moe_layers)
            loss = loss + aux
            metrics.update(router_metrics, total_loss=loss)
        return loss, metrics

    grads, metrics = accumulate_grads(lambda p, _: loss_fn(p), state.params, None, 1, None, loss_scale_of(state.opt))
    params, opt, update_metrics = apply_update(state.tx, state.params, state.opt, grads)
    return state.replace(step=state.step + 1, params=params, opt=opt), {
        f"sft/{k}": unwrap(v) for k, v in {**metrics, **update_metrics}.items()}
