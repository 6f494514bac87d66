"""DAPO's overlong reward shaping (Yu et al. 2025, §3.4 "Overlong Reward Shaping"): a soft
penalty on responses that run into the last `buffer` tokens before the length limit, added to
the task reward (`rollout.overlong_buffer`, `rollout.overlong_penalty`). DAPO's other overlong
option, truncated responses masked out of the loss, is `rollout.truncated: mask`.

    R_length(y) = 0                                  |y| ≤ L_max − L_cache
                = ((L_max − L_cache) − |y|) / L_cache    L_max − L_cache < |y| ≤ L_max
                = −1                                 |y| > L_max

with L_max = rollout.max_new_tokens and L_cache = the buffer; the shaped reward is
R + penalty · R_length (penalty 1: DAPO's).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp


def overlong_penalty(lengths: jax.Array, max_new_tokens: int, buffer: int, penalty: float = 1.0) -> jax.Array:
    """penalty · R_length per response [B] from the response lengths [B] (see the module docstring)."""
    chex.assert_rank(lengths, 1)
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(f"the overlong buffer must lie in (0, max_new_tokens = {max_new_tokens}], got {buffer}")
    length = lengths.astype(jnp.float32)
    soft = max_new_tokens - buffer
    shaped = jnp.where(length <= soft, 0.0, (soft - length) / buffer)
    return penalty * jnp.where(length > max_new_tokens, -1.0, shaped)
