"""MoE dispatch: grouped matmuls over tokens sorted by expert (`experts_ragged`, the model's path)
against computing every expert on every token (`experts_dense`, the test oracle), forward and
forward+backward, side by side in one run; and the matmul roofline of the same machine.

usage: python benchmarks/bench_moe_dispatch.py [--tokens 4096] [--experts 8 32] [--k 2] [--hidden 512]
       [--intermediate 256]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import best_time, machine, roofline_flops

from opd_jax.models.moe import experts_dense, experts_ragged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256)
    args = parser.parse_args()
    N, k, H, I = args.tokens, args.k, args.hidden, args.intermediate
    peak = roofline_flops(jnp.float32, 2048)
    print(f"{machine()}; float32; {N} tokens, top-{k}, hidden {H}, expert width {I}; "
          f"matmul roofline {peak / 1e9:.1f} GFLOP/s\n")
    print("| experts | pass | grouped (ms) | dense (ms) | dense / grouped | grouped % of roofline |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for E in args.experts:
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.normal(size=(N, H)), jnp.float32)
        ids = jnp.asarray(np.argsort(rng.random((N, E)), -1)[:, :k], jnp.int32)
        gates = jnp.asarray(rng.uniform(size=(N, k)), jnp.float32)
        w = [jnp.asarray(rng.normal(scale=0.05, size=s), jnp.float32) for s in ((E, H, I), (E, H, I), (E, I, H))]
        useful = 2 * N * k * 3 * H * I  # the FLOPs of the chosen experts only
        for name, fn in (("forward", lambda f: jax.jit(lambda *a: f(*a))),
                         ("forward+backward", lambda f: jax.jit(jax.grad(lambda x, *a: f(x, *a).sum(),
                                                                         argnums=(0, 3, 4, 5))))):
            times = {}
            for label, impl in (("grouped", experts_ragged), ("dense", experts_dense)):
                step = fn(impl)
                times[label] = best_time(lambda: jax.block_until_ready(step(x, ids, gates, *w)), repeats=5)
            flops = useful * (3 if name == "forward+backward" else 1)
            print(f"| {E} | {name} | {times['grouped'] * 1e3:.1f} | {times['dense'] * 1e3:.1f} | "
                  f"{times['dense'] / times['grouped']:.1f}× | {100 * flops / times['grouped'] / peak:.0f}% |")


if __name__ == "__main__":
    main()
