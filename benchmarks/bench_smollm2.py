"""Forward and decode throughput of SmolLM2-135M against this machine's measured matmul roofline.

    python benchmarks/bench_smollm2.py [--batches 1 8 32] [--seq 128] [--new 64] [--dtype float32]
                                       [--temperature 0 1] [--repeats 1]

The roofline is a large square matmul through JAX in the same run and dtype; every figure is
reported as achieved FLOP/s over that roofline. Forward FLOPs per token count every matmul
(2·params of the projections and the output head) plus causal attention (2·2·n_heads·head_dim per
attended key); decode FLOPs are counted the same way at the mean cache length.

Decode is measured greedy (temperature 0) and sampled (1.0: every step draws a token per row from
the 49k-token vocabulary); with --repeats n, each batch's measurement is repeated n times, each
against a roofline measured just before it, and reported as mean and 95% t-interval. The token
draw alone is timed side by side: the engine's inverse-CDF `draw` against
jax.random.categorical (V Gumbel numbers per row) on the same [32, V] logits.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import best_time, flops_per_token, machine, roofline_flops, t_interval

from opd_jax.models import load_model, smollm2_gguf
from opd_jax.sampling import Sampler, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    dtype = jnp.dtype(args.dtype)
    model, _ = load_model(smollm2_gguf(), dtype=args.dtype)
    config = model.config
    forward = jax.jit(lambda m, t: m.backbone.forward(t)[0])  # hidden states; the head is counted below
    head = jax.jit(lambda m, h: m.logits(h))
    rng = np.random.default_rng(0)
    sampler = Sampler(model, max_cache_len=args.seq + args.new + 1)
    runs: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        roof = roofline_flops(dtype)  # just before the measurements it divides: the machine drifts
        for batch in args.batches:
            tokens = jnp.asarray(rng.integers(0, config.vocab_size, (batch, args.seq)), jnp.int32)
            t_fwd = best_time(lambda: head(model, forward(model, tokens)).block_until_ready())
            fwd_flops = batch * args.seq * flops_per_token(config, (args.seq + 1) / 2)
            prompts = [list(map(int, row)) for row in np.asarray(tokens[:, : args.seq // 2])]
            row = {"repeat": repeat, "batch": batch, "roofline_gflops": roof / 1e9,
                   "forward_tokens_per_s": batch * args.seq / t_fwd, "forward_roofline_fraction": fwd_flops / t_fwd / roof}
            for temperature in args.temperature:
                # decode time = full generation minus a one-token generation (the prefill) of the same prompts
                one = SamplingParams(max_new_tokens=1, temperature=temperature)
                full = SamplingParams(max_new_tokens=args.new, temperature=temperature)
                key = jax.random.key(repeat)
                t_prefill = best_time(lambda: sampler.generate(prompts, one, key))
                t_gen = best_time(lambda: sampler.generate(prompts, full, key))
                steps = args.new - 1
                t_decode = max(t_gen - t_prefill, 1e-9)
                dec_flops = batch * steps * flops_per_token(config, args.seq // 2 + args.new / 2)
                row[f"decode_T{temperature:g}_tokens_per_s"] = batch * steps / t_decode
                row[f"decode_T{temperature:g}_roofline_fraction"] = dec_flops / t_decode / roof
            runs.setdefault(str(batch), []).append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for batch, rows in runs.items():
        summary[batch] = {k: dict(zip(("mean", "low", "high"), t_interval([r[k] for r in rows])))
                          for k in rows[0] if k not in ("repeat", "batch")}
    results = {"machine": machine(), "dtype": args.dtype, "repeats": args.repeats, "runs": runs, "summary": summary,
               "draw_vs_categorical": _draw_vs_categorical(config.vocab_size)}
    print(json.dumps(results, indent=2))


def _draw_vs_categorical(vocab: int, rows: int = 32) -> dict[str, float]:
    """Milliseconds to draw one token per row from [rows, vocab] logits: the engine's `draw` and
    jax.random.categorical, side by side."""
    from opd_jax.sampling.ops import draw

    logits = jax.random.normal(jax.random.key(0), (rows, vocab))
    keys = jax.random.split(jax.random.key(1), rows)
    ours = jax.jit(draw)
    theirs = jax.jit(jax.vmap(jax.random.categorical))
    t_ours = best_time(lambda: ours(keys, logits).block_until_ready(), repeats=20)
    t_theirs = best_time(lambda: theirs(keys, logits).block_until_ready(), repeats=20)
    return {"draw_ms": t_ours * 1e3, "categorical_ms": t_theirs * 1e3, "speedup": t_theirs / t_ours}


if __name__ == "__main__":
    main()
