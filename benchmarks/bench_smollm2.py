"""Forward and decode throughput of SmolLM2-135M against this machine's measured matmul roofline.

    python benchmarks/bench_smollm2.py [--batches 1 8 32] [--seq 128] [--new 64] [--dtype float32]

The roofline is a large square matmul through JAX in the same run and dtype; every figure is
reported as achieved FLOP/s over that roofline. Forward FLOPs per token count every matmul
(2·params of the projections and the output head) plus causal attention (2·2·n_heads·head_dim per
attended key); decode FLOPs are counted the same way at the mean cache length.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import best_time, flops_per_token, machine, roofline_flops

from opd_jax.models import load_model, smollm2_gguf
from opd_jax.sampling import Sampler, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    dtype = jnp.dtype(args.dtype)
    model, _ = load_model(smollm2_gguf(), dtype=args.dtype)
    roof = roofline_flops(dtype)
    config = model.config
    forward = jax.jit(lambda m, t: m.backbone(t)[0])  # hidden states; the head is counted below
    head = jax.jit(lambda m, h: m.logits(h))
    results = {"machine": machine(),
               "dtype": args.dtype, "roofline_gflops": roof / 1e9, "rows": []}
    rng = np.random.default_rng(0)
    sampler = Sampler(model, max_cache_len=args.seq + args.new + 1)
    for batch in args.batches:
        tokens = jnp.asarray(rng.integers(0, config.vocab_size, (batch, args.seq)), jnp.int32)
        t_fwd = best_time(lambda: head(model, forward(model, tokens)).block_until_ready())
        fwd_flops = batch * args.seq * flops_per_token(config, (args.seq + 1) / 2)

        prompts = [list(map(int, row)) for row in np.asarray(tokens[:, : args.seq // 2])]
        # decode time = full generation minus a one-token generation (the prefill) of the same prompts
        greedy_one = SamplingParams(max_new_tokens=1, temperature=0)
        greedy_all = SamplingParams(max_new_tokens=args.new, temperature=0)
        key = jax.random.key(0)
        t_prefill = best_time(lambda: sampler.generate(prompts, greedy_one, key))
        t_gen = best_time(lambda: sampler.generate(prompts, greedy_all, key))
        steps = args.new - 1
        t_decode = max(t_gen - t_prefill, 1e-9)
        dec_flops = batch * steps * flops_per_token(config, args.seq // 2 + args.new / 2)
        row = {"batch": batch, "forward_tokens_per_s": batch * args.seq / t_fwd,
               "forward_roofline_fraction": fwd_flops / t_fwd / roof,
               "decode_tokens_per_s": batch * steps / t_decode,
               "decode_roofline_fraction": dec_flops / t_decode / roof}
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
    # The machine's speed drifts over a run: take the roofline as the best of its start and end,
    # so every fraction is a lower bound.
    roof_end = roofline_flops(dtype)
    if roof_end > roof:
        for row in results["rows"]:
            for key in ("forward_roofline_fraction", "decode_roofline_fraction"):
                row[key] *= roof / roof_end
        results["roofline_gflops"] = roof_end / 1e9
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
