"""What the engine-ratio (bypass) mode saves: one training step (θ_old scoring + the PPO step)
with `old_logprobs: recompute` (the trainer scores the batch first) against `engine` (the
sampler's log-probs are θ_old: no policy forward before the step), side by side in one run, for
GRPO (no critic: the bypass scoring pass does nothing) and PPO with the critic (its value pass
remains). Shapes and models as bench_critic_free.py.

    python benchmarks/bench_bypass.py [--models quickstart smollm2] [--repeats 3]

Writes benchmarks/results/bypass.json.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
from bench_common import best_time, machine
from bench_critic_free import SHAPES, batch_of, model_arguments, policy_of

from opd_jax.core import (
    MismatchCorrection,
    OptimizerConfig,
    PPOConfig,
    PPOState,
    SurrogateConfig,
    make_optimizer,
    ppo_step,
    score_batch,
)
from opd_jax.models import ValueModel

ROOT = Path(__file__).parents[1]


def measure(name: str, repeats: int) -> dict:
    policy = policy_of(name)
    batch = batch_of(policy.config.vocab_size, *SHAPES[name])
    tx = lambda: make_optimizer(OptimizerConfig(learning_rate=1e-6))  # noqa: E731
    out = {}
    for advantage in ("grpo", "gae"):
        critic = ValueModel.from_policy(policy, key=jax.random.key(1)) if advantage == "gae" else None
        state = PPOState.create(policy, critic, tx(), None if critic is None else tx())
        for mode in ("recompute", "engine"):
            config = PPOConfig(advantage=advantage, old_logprobs=mode,
                               surrogate=SurrogateConfig(mismatch=MismatchCorrection("none")))
            score = jax.jit(functools.partial(score_batch, old_logprobs=mode))
            step = jax.jit(functools.partial(ppo_step, config=config, group_size=4))

            def one_step(state=state, score=score, step=step):
                jax.block_until_ready(step(state, score(state, batch))[1])
            out[f"{advantage} {mode}"] = best_time(one_step, repeats)
        out[f"{advantage} speedup"] = out[f"{advantage} recompute"] / out[f"{advantage} engine"]
    out["shape"] = dict(zip(("rows", "prompt", "response"), SHAPES[name]))
    return out


def main() -> None:
    args = model_arguments(__doc__)
    results = {"machine": machine(), "models": {name: measure(name, args.repeats) for name in args.models}}
    (ROOT / "benchmarks" / "results" / "bypass.json").write_text(json.dumps(results, indent=1))
    print("| model | estimator | recompute step s | engine (bypass) step s | speedup |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, r in results["models"].items():
        for advantage in ("grpo", "gae"):
            print(f"| {name} | {advantage} | {r[f'{advantage} recompute']:.3f} | {r[f'{advantage} engine']:.3f} | "
                  f"{r[f'{advantage} speedup']:.2f}× |")


if __name__ == "__main__":
    main()
