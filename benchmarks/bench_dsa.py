"""DeepSeek sparse attention's cost against dense attention, side by side in one run: a tiny GLM-5
(`glm_moe_dsa`: MLA, the indexer in one layer and shared by the next, experts) prefilling T
tokens and decoding one token over a T-slot cache, with top-k 256 and with every key attended
(top-k past T), at T = 1k, 4k, 16k. Best of `--repeats` after a warm-up; the two variants of a T
run one after the other. The sparse path gathers each query's 256 latents; its indexer still
scores every key (cheaply: index_n_heads × index_head_dim per pair).

    python benchmarks/bench_dsa.py [--lengths 1024 4096 16384] [--repeats 3]

Writes benchmarks/results/dsa.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
from bench_common import best_time, machine
from flax import nnx

from opd_jax.models import Decoder, KVCache, ModelConfig
from opd_jax.models.mla import DSAConfig, MLAConfig
from opd_jax.models.moe import MoEConfig

ROOT = Path(__file__).parents[1]
TOPK = 256
SHAPE = ModelConfig(family="glm_moe_dsa", vocab_size=128, hidden_size=128, intermediate_size=256, num_layers=2,
                    num_heads=4, num_kv_heads=4, head_dim=16, max_position_embeddings=32768,
                    moe=MoEConfig(num_experts=4, experts_per_token=2, intermediate_size=64, router="sigmoid",
                                  norm_topk_prob=True, score_correction_bias=True, num_shared_experts=1,
                                  dense_layers=(0,)),
                    mla=MLAConfig(q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                  v_head_dim=32),
                    dsa=DSAConfig(index_topk=TOPK, index_head_dim=32, index_n_heads=4, indexer_types=("full", "shared")))


def variant(topk: int) -> Decoder:
    config = dataclasses.replace(SHAPE, dsa=dataclasses.replace(SHAPE.dsa, index_topk=topk))
    return Decoder(config, rngs=nnx.Rngs(0))


def measure(length: int, repeats: int) -> dict:
    tokens = jax.random.randint(jax.random.key(0), (1, length), 0, SHAPE.vocab_size, jnp.int32)
    prefill = nnx.jit(lambda model, tokens: model(tokens))
    decode = nnx.jit(lambda model, tokens, cache, positions: model.decode(tokens, cache, positions=positions)[0])
    out = {}
    for name, topk in (("sparse", TOPK), ("dense", 10 * length)):
        model = variant(topk)
        # a cache of `length` slots with all but the last filled: the step attends over length - 1 keys
        cache = KVCache.empty(model.config, 1, length, jnp.float32)
        cache = cache.replace(valid=jnp.ones((1, length), bool).at[:, -1].set(False), length=jnp.int32(length - 1))
        last, position = tokens[:, -1:], jnp.full((1, 1), length - 1, jnp.int32)
        out[name] = {
            "prefill_s": best_time(lambda m=model: prefill(m, tokens).block_until_ready(), repeats),
            "decode_s": best_time(lambda m=model, c=cache: decode(m, last, c, position).block_until_ready(), repeats),
        }
    out["sparse_over_dense"] = {k: out["sparse"][k] / out["dense"][k] for k in ("prefill_s", "decode_s")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "dsa.json")
    args = parser.parse_args()
    results = {"machine": machine(), "topk": TOPK, "shape": "hidden 128, 4 heads, kv_lora_rank 64, 2 layers "
               "(indexer in the first, shared by the second)", "lengths": {}}
    for length in args.lengths:
        results["lengths"][length] = measure(length, args.repeats)
        row = results["lengths"][length]
        print(f"T={length}: prefill sparse {row['sparse']['prefill_s']:.3f} s, dense {row['dense']['prefill_s']:.3f} s "
              f"(x{row['sparse_over_dense']['prefill_s']:.2f}); decode sparse {row['sparse']['decode_s'] * 1e3:.2f} ms, "
              f"dense {row['dense']['decode_s'] * 1e3:.2f} ms (x{row['sparse_over_dense']['decode_s']:.2f})", flush=True)
    lengths = sorted(results["lengths"])
    if len(lengths) > 1:  # the growth exponent between the shortest and the longest: 2 is O(T²), 1 is O(T·k)
        a, b = results["lengths"][lengths[0]], results["lengths"][lengths[-1]]
        span = math.log(lengths[-1] / lengths[0])
        results["prefill_growth_exponent"] = {v: math.log(b[v]["prefill_s"] / a[v]["prefill_s"]) / span
                                              for v in ("sparse", "dense")}
        print("prefill time grows as T^", {k: round(v, 2) for k, v in results["prefill_growth_exponent"].items()})
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
