"""Supervised warm start: token-mean cross-entropy on the response tokens, one pure step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from opd_jax.core.batch import RolloutBatch
from opd_jax.core.forward import sequence_logprobs, training_key
from opd_jax.core.losses import aggregate
from opd_jax.core.metrics import unwrap
from opd_jax.core.optim import loss_scale_of
from opd_jax.core.router import router_losses
from opd_jax.core.state import PolicyState
from opd_jax.core.update import accumulate_grads, apply_update


def sft_step(state: PolicyState, batch: RolloutBatch, *, router_balance_coef: float = 0.0,
             index_dense_steps: int = 0) -> tuple[PolicyState, dict[str, jax.Array]]:
    """loss = −Σ m_t · log π(tokens_t | tokens_<t) / Σ m_t over the response mask
    (+ router_balance_coef · the load-balancing loss of a MoE policy's routers, `router_losses`)
    (+ for a state that trains a DSA model's indexers, `state.trains_indexer`: their KL to the
    attention, Σ_layers Σ_t KL_l(t) / Σ_layers Σ_t 1 over every real token's query, `mla.index_kl`;
    its gradient reaches the indexers alone, the cross-entropy's never does. Its first
    `index_dense_steps` steps attend every key and take the KL over them all, DeepSeek-V3.2's dense
    warm-up; later steps attend the indexers' top-k and take it over those keys, its sparse stage);
    one update, skipped (and counted in sft/skipped_nonfinite) when a gradient is not finite.
    (batch.logp_infer and batch.rewards are not used.)"""
    moe_layers = nnx.merge(state.graphdef, state.params).config.moe_layers

    def loss_fn(params, index_loss=None):
        logp, _, router = sequence_logprobs(state.graphdef, params, batch, unroll=True, with_router=True,
                                            dropout_key=training_key(state.step, batch.tokens), index_loss=index_loss)
        loss, _, count = aggregate(-logp, batch.response_mask, "token-mean")
        metrics = {"loss": loss, "tokens": count}
        if router is not None:
            aux, router_metrics = router_losses(router, router_balance_coef, 0.0, moe_layers)
            loss = loss + aux
            metrics.update(router_metrics, total_loss=loss)
        if index_loss is not None:
            # index flips compare with an engine's record, which supervised batches have none of (and the
            # dense warm-up makes no choice): both stages log the same metrics
            metrics = {k: v for k, v in metrics.items() if not k.startswith("dsa/")}
            kl = jnp.sum(router.index_kl[:, 0]) / jnp.maximum(jnp.sum(router.index_kl[:, 1]), 1.0)
            loss = loss + kl
            metrics["index_kl"] = kl
        return loss, metrics

    def grads_of(index_loss=None):
        return accumulate_grads(lambda p, _: loss_fn(p, index_loss), state.params, None, 1, None,
                                loss_scale_of(state.opt), indexer=state.trains_indexer)

    if not state.trains_indexer:
        grads, metrics = grads_of()
    elif index_dense_steps > 0:
        grads, metrics = jax.lax.cond(state.step < index_dense_steps, lambda: grads_of("dense"),
                                      lambda: grads_of("sparse"))
    else:
        grads, metrics = grads_of("sparse")
    params, opt, update_metrics = apply_update(state.tx, state.params, state.opt, grads, indexer=state.trains_indexer)
    return state.replace(step=state.step + 1, params=params, opt=opt), {
        f"sft/{k}": unwrap(v) for k, v in {**metrics, **update_metrics}.items()}
