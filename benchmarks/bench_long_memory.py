"""Memory of one PPO step at growing sequence length, from XLA's compiled memory analysis on
abstract arrays (nothing is allocated, so lengths that no machine here holds are measured): a
Qwen3-0.6B-shaped policy and its critic (28 layers, hidden 1024, 16 query and 8 key heads of 128,
vocabulary 151,936), Adam, one sequence, one device, float32. Each setting is a `models.execution`
(docs/long_sequences.md): plain (dense attention, whole logits, no remat: the trainer before this
work) against the long-sequence knobs.

usage: python benchmarks/bench_long_memory.py [--lengths 512 1024 ...] [--settings plain auto ...]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from opd_jax.core import OptimizerConfig, PPOConfig, PPOState, RolloutBatch, make_optimizer, ppo_step, score_batch  # noqa: E402
from opd_jax.models import Decoder, ModelConfig, ValueModel  # noqa: E402
from opd_jax.models.config import family_defaults  # noqa: E402
from opd_jax.models.execution import Execution  # noqa: E402

QWEN3_06B = ModelConfig(family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                        num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=1 << 20,
                        tie_word_embeddings=True, **family_defaults("qwen3", qk_norm=True))

SETTINGS = {
    "plain": Execution(attention="dense", logits_chunk=1 << 30),
    "auto": Execution(),                                    # the defaults
    "auto+dots": Execution(remat="dots"),
    "auto+full": Execution(remat="full"),
}
GIB = 1 << 30


def abstract_state(execution: Execution) -> PPOState:
    tx = make_optimizer(OptimizerConfig())

    def create() -> PPOState:
        policy = Decoder(QWEN3_06B, rngs=nnx.Rngs(0)).set_execution(execution)
        return PPOState.create(policy, ValueModel.from_policy(policy), tx, tx)

    return jax.eval_shape(create)


def measure(execution: Execution, length: int) -> dict:
    state = abstract_state(execution)
    half = length // 2  # a prompt of half the tokens, a response of the rest
    batch = RolloutBatch(tokens=jnp.zeros((1, length), jnp.int32), attention_mask=jnp.ones((1, length), jnp.int32),
                         response_mask=jnp.zeros((1, length), jnp.float32).at[:, half:].set(1.0),
                         logp_infer=jnp.zeros((1, length), jnp.float32), rewards=jnp.zeros((1,), jnp.float32))
    scored = jax.eval_shape(score_batch, state, batch)
    began = time.perf_counter()
    compiled = jax.jit(lambda s, b: ppo_step(s, b, config=PPOConfig())).lower(state, scored).compile()
    analysis = compiled.memory_analysis()
    return {"temp_gib": analysis.temp_size_in_bytes / GIB, "arguments_gib": analysis.argument_size_in_bytes / GIB,
            "compile_s": time.perf_counter() - began}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; PPO step (policy + critic, Adam), batch 1, float32")
    print("| setting | tokens | temporaries GiB | × per doubling | arguments GiB | compile s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in args.settings:
        previous = None
        for length in args.lengths:
            m = measure(SETTINGS[name], length)
            growth = "" if previous is None else f"{m['temp_gib'] / previous:.2f}"
            previous = m["temp_gib"]
            print(f"| {name} | {length} | {m['temp_gib']:.2f} | {growth} | {m['arguments_gib']:.2f} | "
                  f"{m['compile_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
