"""The optimizer of a policy or critic, built from a typed config: AdamW behind global-norm clipping."""

from __future__ import annotations

import dataclasses
from typing import Literal

import optax


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


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(learning_rate_schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
                        weight_decay=config.weight_decay)
    if config.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)
