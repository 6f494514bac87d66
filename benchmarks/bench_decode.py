"""One decode step of the embedded engine on SmolLM2-135M at 64 rows, by how much of a 640-slot
KV cache is filled (a decode step reads only the 128-slot spans written so far), beside the same
step without the cache (the weights' share) and the sampling of one token per row over the
49k vocabulary, all in one run; with the matmul roofline of the same run.

    python benchmarks/bench_decode.py [--dtypes float32 bfloat16] [--rows 64] [--repeats 5]

Writes benchmarks/results/decode.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
from bench_common import best_time, flops_per_token, machine, roofline_flops
from flax import nnx

from opd_jax.models import KVCache
from opd_jax.models.io import load_model
from opd_jax.models.pretrained import smollm2_gguf
from opd_jax.sampling import sample_tokens

ROOT = Path(__file__).parents[1]
SLOTS = 640  # a long-answer census row: its prompt bucket + 512 new tokens


def measure(dtype: str, rows: int, repeats: int) -> dict:
    model = load_model(smollm2_gguf(), dtype=dtype)[0]
    graphdef, state = nnx.split(model)
    token = jnp.ones((rows, 1), jnp.int32)

    def step(state, cache, filled):
        return nnx.merge(graphdef, state).decode(token, cache, positions=jnp.full((rows, 1), filled),
                                                 attention_mask=jnp.ones((rows, 1), bool))[:2]

    decode = jax.jit(step, donate_argnums=1)
    out: dict = {"step ms by filled slots": {}}
    for filled in (8, 128, 256, 384, 512, 632):
        cache = KVCache.empty(model.config, rows, SLOTS, dtype)
        cache = cache.replace(length=jnp.int32(filled), valid=cache.valid.at[:, :filled].set(True))
        box = [cache]

        def run(box=box, filled=filled):
            logits, box[0] = decode(state, box[0], filled)
            logits.block_until_ready()
            box[0] = box[0].replace(length=jnp.int32(filled))  # the same fill every repeat

        out["step ms by filled slots"][filled] = 1e3 * best_time(run, repeats)
    forward = jax.jit(lambda state: nnx.merge(graphdef, state)(token))
    out["no-cache forward ms"] = 1e3 * best_time(lambda: forward(state).block_until_ready(), repeats)
    logits = 3 * jax.random.normal(jax.random.key(0), (rows, model.config.vocab_size))
    keys = jax.random.split(jax.random.key(1), rows)
    sample = jax.jit(sample_tokens)
    args = (logits, keys, jnp.ones(rows), jnp.zeros(rows, jnp.int32), jnp.ones(rows))
    out["sampling ms"] = 1e3 * best_time(lambda: jax.block_until_ready(sample(*args)), repeats)
    roofline = roofline_flops(jnp.dtype(dtype))
    out["weights' roofline ms"] = 1e3 * rows * flops_per_token(model.config, 0) / roofline
    out["roofline GFLOP/s"] = roofline / 1e9
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    result = {"machine": machine(), "rows": args.rows, "slots": SLOTS,
              "dtypes": {dtype: measure(dtype, args.rows, args.repeats) for dtype in args.dtypes}}
    print(json.dumps(result, indent=1))
    (ROOT / "benchmarks" / "results" / "decode.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
