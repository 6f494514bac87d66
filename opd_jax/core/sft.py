"""Supervised warm start: token-mean cross-entropy on the response tokens, one pure step."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from opd_jax.core.batch import RolloutBatch
from opd_jax.core.losses import aggregate
from opd_jax.core.ppo import sequence_logprobs
from opd_jax.models import Decoder


@flax.struct.dataclass
class SFTState:
    step: jax.Array
    params: nnx.State
    opt: optax.OptState
    graphdef: nnx.GraphDef = flax.struct.field(pytree_node=False)
    tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)

    @classmethod
    def create(cls, model: Decoder, tx: optax.GradientTransformation) -> SFTState:
        graphdef, params = nnx.split(model, nnx.Param)
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt=tx.init(params), graphdef=graphdef, tx=tx)

    def model(self) -> Decoder:
        return nnx.merge(self.graphdef, self.params)


def sft_step(state: SFTState, batch: RolloutBatch) -> tuple[SFTState, dict[str, jax.Array]]:
    """loss = −Σ m_t · log π(tokens_t | tokens_<t) / Σ m_t over the response mask; one update.
    (batch.logp_infer and batch.rewards are not used.)"""
    def loss_fn(params):
        logp, _ = sequence_logprobs(state.graphdef, params, batch, unroll=True)
        loss, _, count = aggregate(-logp, batch.response_mask, "token-mean")
        return loss, count

    (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt = state.tx.update(grads, state.opt, state.params)
    params = optax.apply_updates(state.params, updates)
    return state.replace(step=state.step + 1, params=params, opt=opt), {
        "sft/loss": loss, "sft/tokens": count, "sft/grad_norm": optax.tree.norm(grads)}
