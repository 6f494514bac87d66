"""Continuous against static batching in the embedded engine, side by side in one run, on
requests whose lengths spread as RL rollouts do.

N requests (random prompts of 16-64 tokens, an output budget uniform in [LO, HI] each, no stop
id so each runs to its budget) through S decode slots: static batching decodes them S at a time,
each batch until its longest request ends; continuous batching (`rollout.decode_slots`) gives a
finished request's slot to the next. Both sample every request with the same key, so both
generate the same tokens (checked). Throughput: generated tokens over wall time, after a
compiling pass; per seed (a new draw of lengths), and the ratio's mean with a 95% t-interval.

`--sglang`: the same requests also through a real sglang-jax server (`tools/sglang_jax_env.py`)
with `--max-running-requests` = slots, SGLang's own continuous batching; its CPU path needs
head_dim 128, so this mode serves bench_bridge's model (2 layers, hidden 256) to all three.

usage: python benchmarks/bench_continuous.py [--requests 64] [--slots 16] [--lengths 16 512] [--seeds 0 1 2]
       [--sglang]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from bench_common import machine, t_interval
from bench_ppo_step import CONFIG
from flax import nnx

from opd_jax.models import Decoder
from opd_jax.sampling import Sampler
from rollout_bridge.records import SamplingParams


def workload(seed: int, n: int, lo: int, hi: int, vocab: int) -> tuple[list[list[int]], list[SamplingParams], jax.Array]:
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(1, vocab, int(rng.integers(16, 65)))) for _ in range(n)]
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
    parser.add_argument("--sglang", action="store_true", help="also through a sglang-jax server (bench_bridge's model)")
    args = parser.parse_args()
    config = CONFIG
    if args.sglang:
        from bench_bridge import CONFIG as config  # head_dim 128
    model = Decoder(config, rngs=nnx.Rngs(0))
    cache = 64 + args.lengths[1]
    static = Sampler(model, max_cache_len=cache)
    continuous = Sampler(model, max_cache_len=cache, slots=args.slots)
    lo, hi = args.lengths
    # compile: every static batch shape and the continuous engine's prefill and decode chunk
    warm = workload(999, args.requests, lo, hi, config.vocab_size)
    run_static(static, *warm, args.slots)
    continuous.generate(*warm)
    server = start_server(model, args) if args.sglang else None
    rows = []
    try:
        for seed in args.seeds:
            prompts, params, keys = workload(seed, args.requests, lo, hi, config.vocab_size)
            a, t_static = timed(lambda: run_static(static, prompts, params, keys, args.slots))
            b, t_cont = timed(lambda: continuous.generate(prompts, params, keys))
            same = sum(x.output_ids == y.output_ids for x, y in zip(a, b))
            tokens = sum(len(r.output_ids) for r in a)
            row = {"seed": seed, "tokens": tokens, "static_tok_s": tokens / t_static,
                   "continuous_tok_s": tokens / t_cont, "speedup": t_static / t_cont, "same_tokens": f"{same}/{len(a)}"}
            if server is not None:
                t_sglang = server(prompts, params, tokens)
                row.update(sglang_tok_s=tokens / t_sglang, continuous_over_sglang=t_sglang / t_cont)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        if server is not None:
            server.close()
    summary = {"machine": machine(), "model_params_M": round(sum(x.size for x in jax.tree.leaves(
        nnx.state(model, nnx.Param))) / 1e6, 2), "requests": args.requests, "slots": args.slots,
        "lengths": args.lengths}
    for key in ("speedup", "continuous_over_sglang"):
        if key in rows[0]:
            mean, low, high = t_interval([r[key] for r in rows])
            summary[key] = {"mean": mean, "95ci": [low, high]}
    print(json.dumps(summary, indent=2))


def start_server(model: Decoder, args):
    """A sglang-jax server on the model with `slots` running requests; returns a function timing
    one workload through SGLangEngine (every request's own budget, no stop id), with .close()."""
    from bench_bridge import NO_EOS

    from opd_jax.models import save_model
    from rollout_bridge import sglang_jax
    from rollout_bridge.pipe import LoopThread
    from rollout_bridge.records import Request
    from rollout_bridge.servers import LaunchSpec, ServerGroup
    from rollout_bridge.sglang_engine import SGLangEngine

    root = Path(tempfile.mkdtemp(prefix="bench_continuous_"))
    save_model(model, root / "v0", NO_EOS)
    command = sglang_jax.command(sglang_jax.python(), max_running_requests=args.slots,
                                 max_total_tokens=args.slots * (64 + args.lengths[1]) * 2,
                                 context_length=64 + args.lengths[1] + 8)
    group = ServerGroup(LaunchSpec(tuple(command), env=tuple(sglang_jax.ENV.items()), log_dir=root / "logs"),
                        root / "v0")
    loop = LoopThread("bench-sglang")
    loop.run(group.start())
    engine = SGLangEngine(group.urls, stream=False, max_concurrency=args.requests)

    async def collect(requests):
        return [c async for c in engine.stream(requests)]

    def run(prompts, params, tokens):
        requests = [Request(tuple(int(t) for t in p), q) for p, q in zip(prompts, params)]
        loop.run(collect(requests), timeout=3600)  # first pass: the server compiles its shapes
        began = time.perf_counter()
        done = loop.run(collect(requests), timeout=3600)
        elapsed = time.perf_counter() - began
        assert sum(len(c.output_ids) for c in done) == tokens, "the server ended some requests early"
        return elapsed

    def close():
        loop.run(engine.close())
        loop.run(group.close(), timeout=120)
        loop.stop_loop()

    run.close = close
    return run


if __name__ == "__main__":
    main()
