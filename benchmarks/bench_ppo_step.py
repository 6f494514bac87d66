"""Speed of the PPO step (policy + critic update) against this machine's matmul roofline, and
side by side with Tunix's PPO losses and trainer on the same model size and batch.

    python benchmarks/bench_ppo_step.py [--batch 16] [--prompt 64] [--response 192] [--tunix]
    python benchmarks/bench_ppo_step.py --ragged 16 512 [--tunix]

`--ragged LO HI`: response lengths uniform in [LO, HI] (seeded), rows padded to prompt + HI, and
the step timed on padded rows and on packed ones (`update.pack`, rows of prompt + HI tokens)
side by side; tokens/s counts real tokens only (Tunix pads, as its learner does).

The model is a ~20M-parameter Llama-family decoder (hidden 512, 6 layers, GQA 8/2 heads, vocab
8192, tied head) for the policy, and the same backbone with a value head for the critic. Model
FLOPs of one step: 3 × forward (forward + backward) for each of the two models, over every token
of every epoch; the roofline is a large square matmul in the same run and dtype. `--tunix` (needs
`pip install google-tunix`) times Tunix's PPO update on the same work: its Llama3 model of the
same shape, its PPO policy and value loss functions, one optax AdamW update of each, jitted.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import best_time, flops_per_token, machine, roofline_flops
from flax import nnx

from opd_jax.core import (
    OptimizerConfig,
    PPOConfig,
    PPOState,
    RolloutBatch,
    UpdateConfig,
    make_optimizer,
    ppo_step,
    score_batch,
)
from opd_jax.core.packing import pack_batch
from opd_jax.models import Decoder, ModelConfig, ValueModel

CONFIG = ModelConfig(family="llama", vocab_size=8192, hidden_size=512, intermediate_size=1408, num_layers=6,
                     num_heads=8, num_kv_heads=2, head_dim=64, tie_word_embeddings=True)


def parameter_count(module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def random_batch(batch: int, prompt: int, response: int, seed: int = 0, ragged: tuple[int, int] | None = None
                 ) -> RolloutBatch:
    """Random tokens; every response `response` tokens long, or with `ragged` (lo, hi) of a length
    uniform in [lo, hi], padded to prompt + hi."""
    rng = np.random.default_rng(seed)
    T = prompt + (ragged[1] if ragged else response)
    tokens = rng.integers(0, CONFIG.vocab_size, (batch, T)).astype(np.int32)
    lengths = prompt + (rng.integers(ragged[0], ragged[1] + 1, batch) if ragged else np.full(batch, response))
    real = np.arange(T)[None, :] < lengths[:, None]
    resp = (real & (np.arange(T)[None, :] >= prompt)).astype(np.float32)
    tokens[~real] = 0
    return RolloutBatch(tokens=jnp.asarray(tokens), attention_mask=jnp.asarray(real, jnp.int32),
                        response_mask=jnp.asarray(resp), logp_infer=jnp.asarray(-np.abs(rng.normal(size=(batch, T))) * resp,
                                                                                 jnp.float32),
                        rewards=jnp.asarray(rng.normal(size=batch).astype(np.float32)))


def step_flops(batch: int, seq: int) -> float:
    return sequence_flops(np.full(batch, seq))


def sequence_flops(lengths: np.ndarray) -> float:
    """Model FLOPs of one step (3 × forward of policy and critic) over sequences of `lengths`."""
    total = 0.0
    for n in np.asarray(lengths):
        context = (n + 1) / 2
        total += 3 * (flops_per_token(CONFIG, context) + flops_per_token(CONFIG, context, head=False)) * n
    return total


def time_opd_jax(args, compute_dtype, packed: bool = False) -> float:
    policy = Decoder(CONFIG, compute_dtype=compute_dtype, rngs=nnx.Rngs(0))
    critic = ValueModel.from_policy(policy, head_init="small", key=jax.random.key(1))
    print(f"policy {parameter_count(policy) / 1e6:.1f}M parameters, critic {parameter_count(critic) / 1e6:.1f}M",
          file=sys.stderr)
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-6, max_grad_norm=1.0))
    state = PPOState.create(policy, critic, tx, tx)
    batch = random_batch(args.batch, args.prompt, args.response, ragged=args.ragged)
    if packed:
        batch = pack_batch(batch, groups=args.microbatches)
        print(f"packed {args.batch} rows into {batch.packing[1] * args.microbatches}", file=sys.stderr)
    batch = jax.jit(score_batch)(state, batch)
    config = PPOConfig(update=UpdateConfig(microbatches=args.microbatches, layer_unroll=args.unroll))
    step = jax.jit(functools.partial(ppo_step, config=config), donate_argnums=0)
    start = time.perf_counter()
    step.lower(state, batch).compile()
    print(f"compiled the step in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    holder = [state]

    def run():
        holder[0], metrics = step(holder[0], batch)
        jax.block_until_ready(metrics)

    return best_time(run)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=192)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--unroll", type=int, default=0, help="layers per scan iteration (0: all)")
    parser.add_argument("--dtype", default="float32", help="compute dtype (parameters stay float32)")
    parser.add_argument("--tunix", action="store_true", help="also time Tunix's PPO update on the same work")
    parser.add_argument("--ragged", type=int, nargs=2, metavar=("LO", "HI"),
                        help="response lengths uniform in [LO, HI]; time padded and packed rows")
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    args.unroll = args.unroll or True
    roof = roofline_flops(dtype)
    if args.ragged:
        lengths = np.asarray(random_batch(args.batch, args.prompt, 0, ragged=args.ragged).attention_mask).sum(1)
        seq, flops = args.prompt + args.ragged[1], sequence_flops(lengths)
    else:
        seq = args.prompt + args.response
        lengths, flops = np.full(args.batch, seq), step_flops(args.batch, seq)
    t_ours = time_opd_jax(args, dtype)
    result = {"machine": machine(), "dtype": args.dtype, "batch": args.batch, "seq": seq,
              "real_tokens": int(lengths.sum()), "step_gflop": flops / 1e9, "opd_jax_step_s": t_ours}
    if args.ragged:
        result["opd_jax_packed_step_s"] = t_packed = time_opd_jax(args, dtype, packed=True)
        result["packed_speedup_over_padded"] = t_ours / t_packed
        result["tokens_per_s"] = {"padded": lengths.sum() / t_ours, "packed": lengths.sum() / t_packed}
    if args.tunix:
        from bench_tunix_ppo import time_tunix
        # Tunix trains padded rows: the same batch shape, every row prompt + HI tokens
        response = args.ragged[1] if args.ragged else args.response
        result["tunix_step_s"] = time_tunix(CONFIG, args.batch, args.prompt, response, dtype)
    roof = max(roof, roofline_flops(dtype))  # best of start and end: every fraction is a lower bound
    result["roofline_gflops"] = roof / 1e9
    result["opd_jax_roofline_fraction"] = flops / t_ours / roof
    if args.ragged:
        result["opd_jax_packed_roofline_fraction"] = flops / t_packed / roof
    if args.tunix:
        result["tunix_roofline_fraction"] = flops / result["tunix_step_s"] / roof
        result["opd_jax_speedup_over_tunix"] = result["tunix_step_s"] / t_ours
        if args.ragged:
            result["tokens_per_s"]["tunix"] = lengths.sum() / result["tunix_step_s"]
            result["opd_jax_packed_speedup_over_tunix"] = result["tunix_step_s"] / t_packed
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
