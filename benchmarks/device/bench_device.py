"""The accelerator benchmark, prepared to run as is on a machine with one GPU or TPU, this
repository and no network (it uses the JAX that machine has): one JSON with

- the device's measured matmul roofline (bf16 on an accelerator, f32 on a CPU);
- the PPO step (policy + critic, one update each) on a batch whose responses spread uniformly
  over [lo, hi] tokens, padded and packed (`update.pack`) side by side: seconds, real tokens/s,
  and model FLOP utilisation against that roofline;
- decode tokens/s of the embedded engine at batch 32 and 256 (static batches of fixed-length
  outputs), and continuous batching over 32 slots on ragged budgets.

`--size full` (the default): a 0.5B-parameter Qwen2-style decoder with random weights, bf16
compute; `--size tiny`: a 0.13M one, so the suite runs the whole script on a CPU and it cannot rot.

usage: benchmarks/device/run.sh [--size full|tiny] [--out result.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import flops_per_token  # run.sh puts benchmarks/ on the path
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
from opd_jax.sampling import Sampler
from rollout_bridge.records import SamplingParams


@dataclasses.dataclass(frozen=True)
class Size:
    model: ModelConfig
    batch: int  # PPO step rows
    prompt: int
    response: tuple[int, int]  # response lengths uniform in [lo, hi]
    decode_prompt: int
    decode_new: int
    decode_batches: tuple[int, ...]


SIZES = {
    # Qwen2.5-0.5B's shape (24 layers, hidden 896, 14/2 heads, MLP 4864, vocab 151936 tied): 0.49B
    "full": Size(ModelConfig(family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                             num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, qkv_bias=True,
                             tie_word_embeddings=True, max_position_embeddings=2048),
                 batch=16, prompt=128, response=(32, 896), decode_prompt=128, decode_new=128,
                 decode_batches=(32, 256)),
    "tiny": Size(ModelConfig(family="qwen2", vocab_size=512, hidden_size=64, intermediate_size=192, num_layers=2,
                             num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, tie_word_embeddings=True,
                             max_position_embeddings=256),
                 batch=8, prompt=16, response=(4, 48), decode_prompt=16, decode_new=8, decode_batches=(4, 8)),
}


def timed(fn, repeats: int = 3) -> float:
    """Best wall time of `repeats` calls after one that compiles."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - began)
    return best


def roofline(dtype) -> float:
    n = 8192 if jax.default_backend() != "cpu" else 2048
    a = jnp.ones((n, n), dtype)
    matmul = jax.jit(lambda x: x @ x)
    return 2 * n**3 / timed(lambda: matmul(a), repeats=10)


def ragged_batch(size: Size, seed: int = 0) -> tuple[RolloutBatch, np.ndarray]:
    rng = np.random.default_rng(seed)
    lo, hi = size.response
    T = size.prompt + hi
    lengths = size.prompt + rng.integers(lo, hi + 1, size.batch)
    real = np.arange(T)[None] < lengths[:, None]
    response = (real & (np.arange(T)[None] >= size.prompt)).astype(np.float32)
    tokens = np.where(real, rng.integers(0, size.model.vocab_size, (size.batch, T)), 0).astype(np.int32)
    batch = RolloutBatch(tokens=jnp.asarray(tokens), attention_mask=jnp.asarray(real, jnp.int32),
                         response_mask=jnp.asarray(response),
                         logp_infer=jnp.asarray(-np.abs(rng.normal(size=real.shape)) * response, jnp.float32),
                         rewards=jnp.asarray(rng.normal(size=size.batch), jnp.float32))
    return batch, lengths


def step_flops(config: ModelConfig, lengths: np.ndarray) -> float:
    """3 × forward (forward + backward) of policy and critic over every real token."""
    return float(sum(3 * (flops_per_token(config, (n + 1) / 2) + flops_per_token(config, (n + 1) / 2, head=False)) * n
                     for n in lengths))


def ppo(size: Size, compute_dtype, peak: float) -> dict:
    policy = Decoder(size.model, compute_dtype=compute_dtype, rngs=nnx.Rngs(0))
    critic = ValueModel.from_policy(policy, head_init="small", key=jax.random.key(1))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(policy, nnx.Param)))
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-6, max_grad_norm=1.0))
    state = PPOState.create(policy, critic, tx, tx)
    padded, lengths = ragged_batch(size)
    flops = step_flops(size.model, lengths)
    step = jax.jit(functools.partial(ppo_step, config=PPOConfig(update=UpdateConfig())))
    out = {"policy_params": int(params), "batch": size.batch, "rows_tokens": int(padded.tokens.shape[1]),
           "real_tokens": int(lengths.sum()), "step_tflop": flops / 1e12}
    for name, batch in (("padded", padded), ("packed", pack_batch(padded, groups=1))):
        scored = jax.jit(score_batch)(state, batch)
        began = time.perf_counter()
        compiled = step.lower(state, scored).compile()
        compile_s = time.perf_counter() - began
        seconds = timed(lambda: compiled(state, scored)[1])  # the state is not donated: every call is the same step
        out[name] = {"compile_s": compile_s, "step_s": seconds,
                     "tokens_per_s": float(lengths.sum() / seconds), "mfu": flops / seconds / peak,
                     **({"rows": batch.packing[1]} if batch.packing else {"rows": size.batch})}
    out["packed_speedup"] = out["padded"]["step_s"] / out["packed"]["step_s"]
    return out


def decode(size: Size, compute_dtype) -> dict:
    model = Decoder(size.model, compute_dtype=compute_dtype, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    cache = size.decode_prompt + size.decode_new
    out = {}
    for batch in size.decode_batches:
        prompts = [list(rng.integers(1, size.model.vocab_size, size.decode_prompt)) for _ in range(batch)]
        sampler = Sampler(model, max_cache_len=cache)
        keys = jax.random.split(jax.random.key(0), batch)
        params = SamplingParams(max_new_tokens=size.decode_new, temperature=1.0)
        seconds = timed(lambda: sampler.generate(prompts, params, keys), repeats=2)
        out[f"static_batch_{batch}"] = {"tokens_per_s": batch * size.decode_new / seconds, "s": seconds}
    # continuous: 4 × the first batch size of requests, budgets uniform in [new/8, new], through that many slots
    slots = size.decode_batches[0]
    budgets = rng.integers(max(1, size.decode_new // 8), size.decode_new + 1, 4 * slots)
    prompts = [list(rng.integers(1, size.model.vocab_size, size.decode_prompt)) for _ in budgets]
    params = [SamplingParams(max_new_tokens=int(b), temperature=1.0) for b in budgets]
    keys = jax.random.split(jax.random.key(1), len(budgets))
    for name, sampler in (("static", Sampler(model, max_cache_len=cache)),
                          ("continuous", Sampler(model, max_cache_len=cache, slots=slots))):
        if name == "static":
            def run(s=sampler):
                return [r for i in range(0, len(prompts), slots)
                        for r in s.generate(prompts[i:i + slots], params[i:i + slots], keys[i:i + slots])]
        else:
            def run(s=sampler):
                return s.generate(prompts, params, keys)
        seconds = timed(run, repeats=2)
        out[f"ragged_{name}_{slots}_slots"] = {"tokens_per_s": float(budgets.sum() / seconds), "s": seconds}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--out", type=Path, default=Path("device_bench.json"))
    args = parser.parse_args()
    size = SIZES[args.size]
    backend = jax.default_backend()
    if args.size == "full" and backend == "cpu":
        print("note: no accelerator found (JAX backend: cpu); the full size will be slow here", file=sys.stderr)
    dtype = jnp.float32 if backend == "cpu" else jnp.bfloat16
    began = time.perf_counter()
    peak = roofline(dtype)
    result = {"date": time.strftime("%Y-%m-%d"), "size": args.size, "backend": backend,
              "device": jax.devices()[0].device_kind, "devices": jax.device_count(), "jax": jax.__version__,
              "host": platform.machine(), "dtype": jnp.dtype(dtype).name, "roofline_tflops": peak / 1e12}
    print(f"roofline {peak / 1e12:.2f} TFLOP/s ({jnp.dtype(dtype).name})", file=sys.stderr)
    result["ppo_step"] = ppo(size, dtype, peak)
    print(f"ppo step: {json.dumps(result['ppo_step'])}", file=sys.stderr)
    result["decode"] = decode(size, dtype)
    result["wall_s"] = time.perf_counter() - began
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
