"""The optimizer of a policy or critic, built from a typed config: AdamW behind global-norm
clipping; for a model that computes in float16, with a dynamic loss scale (DeepMind's jmp) kept
in the optimizer's state, so it is checkpointed and resumed with it."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import jmp
import optax

# jmp's defaults (NVIDIA's): start at 2^15; halve on an overflow, double after 2000 finite updates
INITIAL_LOSS_SCALE = 2.0 ** 15


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with an optional linear warm-up and cosine decay, after clipping the gradient's
    global norm to `max_grad_norm` (None: no clipping)."""

    __pydantic_config__ = {"use_attribute_docstrings": True, "extra": "forbid"}  # as the config sections

    learning_rate: float = 1e-6
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    b1: float = 0.9
    """Adam β1."""
    b2: float = 0.999
    """Adam β2."""
    eps: float = 1e-8
    """Adam ε."""
    max_grad_norm: float | None = 1.0
    """Clip the gradient's global norm to this; unset: no clipping."""
    warmup_steps: int = 0
    """Linear warm-up from 0 over this many updates."""
    schedule: Literal["constant", "cosine"] = "constant"
    """constant (after warm-up) or cosine decay to final_lr_fraction × learning_rate."""
    decay_steps: int = 0
    """Length of the cosine schedule in updates (warm-up included)."""
    final_lr_fraction: float = 0.0
    """Where the cosine schedule ends, as a fraction of learning_rate."""

    def __post_init__(self):
        if self.learning_rate < 0 or self.weight_decay < 0:
            raise ValueError("learning_rate and weight_decay must be >= 0")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"unknown learning-rate schedule {self.schedule!r}; use 'constant' or 'cosine'")
        if self.schedule == "cosine" and self.decay_steps <= self.warmup_steps:
            raise ValueError("a cosine schedule needs decay_steps > warmup_steps")


def learning_rate_schedule(config: OptimizerConfig) -> optax.Schedule:
    if config.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, config.warmup_steps,
                                                  config.decay_steps, config.final_lr_fraction * config.learning_rate)
    if config.warmup_steps:
        return optax.join_schedules([optax.linear_schedule(0.0, config.learning_rate, config.warmup_steps),
                                     optax.constant_schedule(config.learning_rate)], [config.warmup_steps])
    return optax.constant_schedule(config.learning_rate)


class LossScaledState(NamedTuple):
    """The state of a loss-scaled optimizer: the inner optimizer's, and the dynamic loss scale
    (adjusted by `update.apply_update`, which sees whether the gradient was finite). Plain arrays,
    so the state shards and checkpoints as any other; jmp's DynamicLossScale holds the rules."""

    inner: optax.OptState
    loss_scale: jax.Array  # float32 []
    finite_updates: jax.Array  # int32 []: finite updates since the scale last changed (jmp's counter)

    @property
    def scaler(self) -> jmp.DynamicLossScale:
        return jmp.DynamicLossScale(self.loss_scale, self.finite_updates)


def loss_scaled(tx: optax.GradientTransformation, initial: float = INITIAL_LOSS_SCALE) -> optax.GradientTransformation:
    """`tx` with a dynamic loss scale in its state. The loss is multiplied by the scale before
    its gradient is taken (`update.accumulate_grads`), and the gradient divided by it before
    `tx` sees it (`update.apply_update`): float16 activations' small gradients survive."""
    def init(params: Any) -> LossScaledState:
        return LossScaledState(tx.init(params), jnp.asarray(initial, jnp.float32), jnp.zeros((), jnp.int32))

    def update(grads: Any, state: LossScaledState, params: Any = None) -> tuple[Any, LossScaledState]:
        updates, inner = tx.update(grads, state.inner, params)
        return updates, state._replace(inner=inner)

    return optax.GradientTransformation(init, update)


def loss_scale_of(opt_state: Any) -> jmp.LossScale:
    """The loss scale an optimizer state holds (1, a no-op, unless it is loss-scaled)."""
    return opt_state.scaler if isinstance(opt_state, LossScaledState) else jmp.NoOpLossScale()


def make_optimizer(config: OptimizerConfig, *, compute_dtype: Any = None) -> optax.GradientTransformation:
    """The optimizer of `config`; for a model computing in float16, loss-scaled (`loss_scaled`)."""
    adamw = optax.adamw(learning_rate_schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
                        weight_decay=config.weight_decay)
    tx = adamw if config.max_grad_norm is None else optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)
    return loss_scaled(tx) if compute_dtype is not None and jnp.dtype(compute_dtype) == jnp.float16 else tx
