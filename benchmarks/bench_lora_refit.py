"""A LoRA policy in the embedded engine, two ways side by side in one run: merged (each refit
builds the whole model with the adapters folded in, the engine's copy of every weight) and base +
adapters (the engine keeps the base it was first given; a refit moves the adapters alone:
`WeightUpdate.adapters`, `Sampler.update_adapters`). For each: the refit's time and the bytes it
builds, and one decode step's time (the adapters' two thin matmuls per projection are the
price of not merging), best of `--repeats`.

    python benchmarks/bench_lora_refit.py [--models quickstart smollm2] [--repeats 3]

Adapters rank 16 on every projection (α 32), B drawn at random. The decode step: 64 rows (8 for
smollm2: bench_critic_free.py's batch) against a 256-slot KV cache filled to 128, float32. One
CPU device; writes benchmarks/results/lora_refit.json.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from bench_common import best_time, measure_models
from bench_critic_free import ROOT, SHAPES, model_arguments, policy_of
from flax import nnx

from opd_jax.models import KVCache
from opd_jax.models.lora import LoraConfig
from opd_jax.sampling import Sampler
from opd_jax.train.build import EngineNumerics, engine_adapters, engine_model

LORA = LoraConfig(rank=16, alpha=32.0)
SLOTS, FILLED = 256, 128


def decode_ms(sampler: Sampler, rows: int, repeats: int) -> float:
    graphdef, config = sampler.graphdef, sampler.config
    token = jnp.ones((rows, 1), jnp.int32)
    step = jax.jit(lambda state, cache: nnx.merge(graphdef, state).decode(
        token, cache, positions=jnp.full((rows, 1), FILLED), attention_mask=jnp.ones((rows, 1), bool))[0])
    cache = KVCache.empty(config, rows, SLOTS, "float32")
    cache = cache.replace(length=jnp.int32(FILLED), valid=cache.valid.at[:, :FILLED].set(True))
    return 1e3 * best_time(lambda: step(sampler.state, cache).block_until_ready(), repeats)


def measure(name: str, repeats: int) -> dict:
    policy = policy_of(name).add_lora(LORA, nnx.Rngs(0))
    keys = iter(jax.random.split(jax.random.key(1), 64))
    for key, var in vars(policy.backbone.layers).items():
        if key.endswith("_lora_b"):
            var[...] = 0.02 * jax.random.normal(next(keys), var[...].shape, var[...].dtype)
    params, numerics, rows = nnx.state(policy, nnx.Param), EngineNumerics(), SHAPES[name][0]
    out = {}
    for label, adapters in (("merged", False), ("base + adapters", True)):
        sampler = Sampler(engine_model(policy.config, params, numerics, adapters=adapters), max_cache_len=SLOTS)
        if adapters:
            def refit():
                sampler.update_adapters(engine_adapters(params, numerics), 1)
                return jax.block_until_ready(sampler.state)
            moved = engine_adapters(params, numerics)
        else:
            def refit():
                sampler.update_weights(engine_model(policy.config, params, numerics, adapters=False), 1)
                return jax.block_until_ready(sampler.state)
            moved = nnx.state(engine_model(policy.config, params, numerics, adapters=False))
        out[label] = {"refit_ms": 1e3 * best_time(refit, repeats),
                      "refit_gib": sum(x.nbytes for x in jax.tree.leaves(moved)) / 2**30,
                      "decode_step_ms": decode_ms(sampler, rows, repeats)}
    out["base + adapters"]["vs_merged"] = {k: out["base + adapters"][k] / out["merged"][k]
                                            for k in ("refit_ms", "refit_gib", "decode_step_ms")}
    out["shape"] = {"rows": rows, "slots": SLOTS, "filled": FILLED, "rank": LORA.rank}
    return out


def main() -> None:
    args = model_arguments(__doc__)
    results = measure_models(measure, args.models, args.repeats, ROOT / "benchmarks" / "results" / "lora_refit.json")
    print("| model | engine holds | refit ms | refit GiB | decode step ms |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, r in results["models"].items():
        for label in ("merged", "base + adapters"):
            x = r[label]
            ratio = lambda k: f" ({x['vs_merged'][k]:.2f}×)" if "vs_merged" in x else ""  # noqa: E731
            print(f"| {name} | {label} | {x['refit_ms']:.1f}{ratio('refit_ms')} | {x['refit_gib']:.4f}"
                  f"{ratio('refit_gib')} | {x['decode_step_ms']:.2f}{ratio('decode_step_ms')} |")


if __name__ == "__main__":
    main()
