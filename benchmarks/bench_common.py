"""What every benchmark shares: best-of-n timing, the machine's matmul roofline measured in the
same run, the model-FLOP count of a decoder forward pass, and the t-interval of a mean over seeds."""

from __future__ import annotations

import json
import platform
import resource
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats


def best_time(fn: Callable[[], object], repeats: int = 3) -> float:
    fn()  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def roofline_flops(dtype, n: int = 4096) -> float:
    """Best FLOP/s of an n×n×n matmul over several repeats."""
    a = jnp.ones((n, n), dtype)
    b = jnp.ones((n, n), dtype)
    matmul = jax.jit(lambda a, b: a @ b)
    return 2 * n**3 / best_time(lambda: matmul(a, b).block_until_ready(), repeats=8)


def flops_per_token(config, context: float, *, head: bool = True) -> float:
    """Forward FLOPs of one token: 2·(projection and MLP weights [+ output head]) plus causal
    attention, 2·2·n_heads·head_dim per attended key (`context` keys on average)."""
    c = config
    projections = (c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
                   + 3 * c.hidden_size * c.intermediate_size)
    dense = 2 * (c.num_layers * projections + (c.hidden_size * c.vocab_size if head else 0))
    attention = c.num_layers * 4 * c.num_heads * c.head_dim * context
    return dense + attention


def machine() -> str:
    return f"{platform.machine()}, {jax.device_count()} x {jax.devices()[0].device_kind}"


def measure_models(measure: Callable[[str, int], dict], models: list[str], repeats: int, result: Path) -> dict:
    """{"machine", "models": {name: measure(name, repeats)}, "peak_rss_gib"}, written to `result`."""
    results = {"machine": machine(), "models": {name: measure(name, repeats) for name in models},
               "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    result.write_text(json.dumps(results, indent=1))
    return results


def t_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): Student's t-interval of the mean (n − 1 degrees of freedom)."""
    x = np.asarray(values, np.float64)
    mean = float(x.mean())
    if len(x) < 2:
        return mean, float("nan"), float("nan")
    half = float(stats.t.ppf(0.5 + level / 2, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x)))
    return mean, mean - half, mean + half
