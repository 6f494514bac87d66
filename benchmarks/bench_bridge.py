"""The bridge's cost and the engines side by side, on one tiny Llama (head_dim 128) served by a
real sglang-jax server on loopback:

    python benchmarks/bench_bridge.py [--concurrency 64] [--new 32] [--rounds 3]

1. Bridge overhead: the same `concurrency` requests sent straight to `/generate` with httpx and
   through `SGLangEngine` (plain, streamed one event per token, streamed one per 8 tokens:
   `rollout.sglang.stream_interval`), alternating, best of `rounds`; the overhead is bridge time
   over direct time, minus one.
2. Tokens/s: the embedded JAX sampler and sglang-jax on the same model, batch and lengths.
3. Time to refit: `update_weights` by restart (sglang-jax has no update_weights_from_disk), from
   the HF export to the first request the new server answers.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import jax
from bench_common import machine
from flax import nnx

from opd_jax.models import Decoder, save_model
from opd_jax.models.char_tokenizer import char_tokenizer
from opd_jax.models.config import ModelConfig
from opd_jax.sampling import Sampler
from rollout_bridge import sglang_api, sglang_jax
from rollout_bridge.pipe import LoopThread
from rollout_bridge.protocol import WeightUpdate
from rollout_bridge.records import Request, SamplingParams
from rollout_bridge.servers import LaunchSpec, ServerGroup
from rollout_bridge.sglang_engine import SGLangEngine

TOKENIZER = char_tokenizer()
NO_EOS = dataclasses.replace(TOKENIZER, eos_token=None)  # every rollout runs its full length
CONFIG = ModelConfig(family="llama", vocab_size=TOKENIZER.vocab_size, hidden_size=256, intermediate_size=512,
                     num_layers=2, num_heads=2, num_kv_heads=1, head_dim=128, max_position_embeddings=512)


async def direct(url: str, requests: list[Request]) -> float:
    limits = httpx.Limits(max_connections=len(requests) + 16, max_keepalive_connections=len(requests) + 16)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        began = time.perf_counter()
        responses = await asyncio.gather(*(client.post(url + "/generate", json=sglang_api.generate_body(
            r, f"d-{r.request_id}", stream=False)) for r in requests))
        elapsed = time.perf_counter() - began
    assert all(x.status_code == 200 for x in responses)
    return elapsed


async def bridged(engine: SGLangEngine, requests: list[Request]) -> float:
    began = time.perf_counter()
    done = [c async for c in engine.stream(requests)]
    elapsed = time.perf_counter() - began
    assert len(done) == len(requests) and all(len(c.output_ids) == c.metadata["n"] for c in done)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    params = SamplingParams(max_new_tokens=args.new, temperature=1.0)
    prompts = [tuple(range(3 + i % 7, 12 + i % 11)) for i in range(args.concurrency)]

    def batch() -> list[Request]:
        return [Request(p, params, {"n": args.new}) for p in prompts]

    root = Path(tempfile.mkdtemp(prefix="bench_bridge_"))
    model = Decoder(CONFIG, rngs=nnx.Rngs(0))
    save_model(model, root / "v0", NO_EOS)
    spec = LaunchSpec(tuple(sglang_jax.command(sglang_jax.python(), max_running_requests=args.concurrency)),
                      env=tuple(sglang_jax.ENV.items()), log_dir=root / "logs")
    group = ServerGroup(spec, root / "v0")
    loop = LoopThread("bench")
    results: dict[str, object] = {"machine": machine(), "date": time.strftime("%Y-%m-%d"),
                                  "concurrency": args.concurrency, "new_tokens": args.new}
    try:
        began = time.perf_counter()
        loop.run(group.start())
        results["server_start_s"] = time.perf_counter() - began
        url = group.urls[0]
        plain = SGLangEngine([url], stream=False, max_concurrency=args.concurrency)
        streamed = SGLangEngine([url], stream=True, max_concurrency=args.concurrency)
        streamed_8 = SGLangEngine([url], stream=True, stream_interval=8, max_concurrency=args.concurrency)
        loop.run(direct(url, batch()))  # warm-up: every shape the server will see
        times: dict[str, list[float]] = {"direct": [], "bridge_plain": [], "bridge_stream": [], "bridge_stream_8": []}
        for _ in range(args.rounds):
            times["direct"].append(loop.run(direct(url, batch())))
            times["bridge_plain"].append(loop.run(bridged(plain, batch())))
            times["bridge_stream"].append(loop.run(bridged(streamed, batch())))
            times["bridge_stream_8"].append(loop.run(bridged(streamed_8, batch())))
        best = {k: min(v) for k, v in times.items()}
        tokens = args.concurrency * args.new
        results.update({f"{k}_s": v for k, v in best.items()})
        results["overhead_plain"] = best["bridge_plain"] / best["direct"] - 1
        results["overhead_stream"] = best["bridge_stream"] / best["direct"] - 1
        results["overhead_stream_interval_8"] = best["bridge_stream_8"] / best["direct"] - 1
        results["sglang_tokens_per_s"] = tokens / best["direct"]

        sampler = Sampler(model, max_cache_len=64 + args.new)
        run = lambda: sampler.generate(list(prompts), params, jax.random.key(0))  # noqa: E731
        run()
        embedded = min(_timed(run) for _ in range(args.rounds))
        results["embedded_s"] = embedded
        results["embedded_tokens_per_s"] = tokens / embedded
        results["embedded_over_sglang"] = results["embedded_tokens_per_s"] / results["sglang_tokens_per_s"]

        refit = SGLangEngine(servers=group, refit="auto", refit_dir=root / "refit")
        began = time.perf_counter()
        loop.run(refit.update_weights(WeightUpdate(1, save_hf=lambda d: save_model(Decoder(CONFIG, rngs=nnx.Rngs(1)),
                                                                                     d, NO_EOS))))
        loop.run(bridged(refit, [Request(prompts[0], SamplingParams(max_new_tokens=1), {"n": 1})]))
        results["refit_restart_s"] = time.perf_counter() - began
        for engine in (plain, streamed, streamed_8, refit):
            loop.run(engine.close())
    finally:
        loop.run(group.close(), timeout=120)
        loop.stop_loop()
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


def _timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


if __name__ == "__main__":
    sys.exit(main())
