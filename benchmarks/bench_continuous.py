"""Continuous against static batching in the embedded engine, side by side in one run, on
requests whose lengths spread as RL rollouts do.

N requests (random prompts of 16-64 tokens, an output budget uniform in [LO, HI] each, no stop
id so each runs to its budget) through S decode slots: static batching decodes them S at a time,
each batch until its longest request ends; continuous batching (`rollout.decode_slots`) gives a
finished request's slot to the next. Both sample every request with the same key, so both
generate the same tokens (checked). Throughput: generated tokens over wall time, after a
compiling pass; per seed (a new draw of lengths), and the ratio's mean with a 95% t-interval.

usage: python benchmarks/bench_continuous.py [--requests 64] [--slots 16] [--lengths 16 512] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
from bench_common import machine, t_interval
from bench_ppo_step import CONFIG
from flax import nnx

from opd_jax.models import Decoder
from opd_jax.sampling import Sampler
from rollout_bridge.records import SamplingParams


def workload(seed: int, n: int, lo: int, hi: int) -> tuple[list[list[int]], list[SamplingParams], jax.Array]:
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(1, CONFIG.vocab_size, int(rng.integers(16, 65)))) for _ in range(n)]
    params = [SamplingParams(max_new_tokens=int(rng.integers(lo, hi + 1)), temperature=1.0) for _ in range(n)]
    return prompts, params, jax.random.split(jax.random.key(seed), n)


def run_static(sampler: Sampler, prompts, params, keys, slots: int):
    out = []
    for i in range(0, len(prompts), slots):
        out += sampler.generate(prompts[i:i + slots], params[i:i + slots], keys[i:i + slots])
    return out


def timed(fn):
    began = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--lengths", type=int, nargs=2, default=[16, 512], metavar=("LO", "HI"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    model = Decoder(CONFIG, rngs=nnx.Rngs(0))
    cache = 64 + args.lengths[1]
    static = Sampler(model, max_cache_len=cache)
    continuous = Sampler(model, max_cache_len=cache, slots=args.slots)
    lo, hi = args.lengths
    # compile: every static batch shape and the continuous engine's prefill and decode chunk
    warm = workload(999, args.requests, lo, hi)
    run_static(static, *warm, args.slots)
    continuous.generate(*warm)
    rows = []
    for seed in args.seeds:
        prompts, params, keys = workload(seed, args.requests, lo, hi)
        a, t_static = timed(lambda: run_static(static, prompts, params, keys, args.slots))
        b, t_cont = timed(lambda: continuous.generate(prompts, params, keys))
        same = sum(x.output_ids == y.output_ids for x, y in zip(a, b))
        tokens = sum(len(r.output_ids) for r in a)
        rows.append({"seed": seed, "tokens": tokens, "static_tok_s": tokens / t_static,
                     "continuous_tok_s": tokens / t_cont, "speedup": t_static / t_cont,
                     "same_tokens": f"{same}/{len(a)}"})
        print(json.dumps(rows[-1]), flush=True)
    mean, low, high = t_interval([r["speedup"] for r in rows])
    print(json.dumps({"machine": machine(), "model_params_M": round(sum(x.size for x in jax.tree.leaves(
        nnx.state(model, nnx.Param))) / 1e6, 1), "requests": args.requests, "slots": args.slots,
        "lengths": args.lengths, "speedup_mean": mean, "speedup_95ci": [low, high]}, indent=2))


if __name__ == "__main__":
    main()
