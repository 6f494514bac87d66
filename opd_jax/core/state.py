"""The train state of a step that trains one policy (the supervised warm start, OPD): its
parameters (nnx.State, which keeps each parameter's logical axes), optimizer state and step
count. The graph definition and optimizer are static."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from opd_jax.core.update import trainable
from opd_jax.models import Decoder


@flax.struct.dataclass
class PolicyState:
    step: jax.Array
    params: nnx.State
    opt: optax.OptState
    graphdef: nnx.GraphDef = flax.struct.field(pytree_node=False)
    tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
    # a DSA model's indexers trained too, by their KL to the attention (`sft_step`)
    trains_indexer: bool = flax.struct.field(pytree_node=False, default=False)

    @classmethod
    def create(cls, model: Decoder, tx: optax.GradientTransformation, *, trains_indexer: bool = False) -> PolicyState:
        graphdef, params = nnx.split(model, nnx.Param)
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt=tx.init(trainable(params, indexer=trains_indexer)),
                   graphdef=graphdef, tx=tx, trains_indexer=trains_indexer)

    def model(self) -> Decoder:
        return nnx.merge(self.graphdef, self.params)
