"""GAE as one reverse `lax.scan` (opd_jax.core.gae) against the same recurrence as an
associative scan, side by side, at a few batch × length sizes.

    python benchmarks/bench_gae.py

The associative form writes both passes as linear recurrences x_t = a_t·x_{t+1} + b_t: the next
masked token's value (a = 1 − m, b = m·V), then A'_t = m·δ_t + (m·γλ + 1 − m)·A'_{t+1}, A = m·A'.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import best_time, machine

from opd_jax.core import gae


def _linear_reverse(a: jax.Array, b: jax.Array) -> jax.Array:
    def compose(later, earlier):
        return later[0] * earlier[0], earlier[0] * later[1] + earlier[1]
    return jax.lax.associative_scan(compose, (a, b), reverse=True, axis=1)[1]


def gae_associative(rewards, values, mask, gamma, lam):
    nxt = _linear_reverse(1 - mask, mask * values)
    next_value = jnp.pad(nxt[:, 1:], ((0, 0), (0, 1)))
    delta = rewards + gamma * next_value - values
    adv = _linear_reverse(mask * gamma * lam + (1 - mask), mask * delta) * mask
    return adv, (adv + values) * mask


def main() -> None:
    rng = np.random.default_rng(0)
    rows = []
    for B, T in ((16, 256), (256, 2048), (64, 16384)):
        m = (rng.uniform(size=(B, T)) < 0.9).astype(np.float32)
        args = [jnp.asarray(x) for x in (rng.normal(size=(B, T)).astype(np.float32) * m,
                                          rng.normal(size=(B, T)).astype(np.float32), m)]
        scan = jax.jit(lambda r, v, m: gae(r, v, m, 1.0, 0.95)[0])
        assoc = jax.jit(lambda r, v, m: gae_associative(r, v, m, 1.0, 0.95)[0])
        np.testing.assert_allclose(np.asarray(scan(*args)), np.asarray(assoc(*args)), atol=1e-4)
        t_scan = best_time(lambda: scan(*args).block_until_ready(), repeats=10)
        t_assoc = best_time(lambda: assoc(*args).block_until_ready(), repeats=10)
        rows.append({"batch": B, "length": T, "scan_ms": 1e3 * t_scan, "associative_ms": 1e3 * t_assoc,
                     "associative_over_scan": t_assoc / t_scan})
    print(json.dumps({"machine": machine(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
