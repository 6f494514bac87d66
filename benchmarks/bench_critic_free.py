"""What a critic-free run saves now that it builds no critic: memory (weights and optimizer state
held) and time of one training step (θ_old scoring + GRPO's PPO step), side by side in one run,
GRPO on a state with a critic (what every GRPO run held and scored before) against one without.

    python benchmarks/bench_critic_free.py [--models quickstart smollm2] [--repeats 3]

quickstart: configs/quickstart.yaml's model (a 0.6M-parameter Llama from scratch) on its batch
(16 prompts × 4 samples, 24 prompt + 8 response tokens). smollm2: SmolLM2-135M-Instruct (the
packaged GGUF, float32) on 2 prompts × 4 samples of 64 + 64 tokens. Both: AdamW, one mini-batch.
Writes benchmarks/results/critic_free.json.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import numpy as np
from bench_common import best_time, measure_models

from opd_jax.config import load_config
from opd_jax.core import OptimizerConfig, PPOConfig, PPOState, RolloutBatch, make_optimizer, ppo_step, score_batch
from opd_jax.models import ValueModel, load_model, smollm2_gguf
from opd_jax.train import build_model

ROOT = Path(__file__).parents[1]
SHAPES = {"quickstart": (64, 24, 8), "smollm2": (8, 64, 64)}  # rows, prompt tokens, response tokens


def policy_of(name: str):
    if name == "quickstart":
        return build_model(load_config(ROOT / "configs" / "quickstart.yaml").model)[0]
    return load_model(smollm2_gguf(), dtype="float32")[0]


def batch_of(vocab: int, rows: int, prompt: int, response: int) -> RolloutBatch:
    rng = np.random.default_rng(0)
    T = prompt + response
    mask = np.zeros((rows, T), np.float32)
    mask[:, prompt:] = 1
    return RolloutBatch(tokens=rng.integers(0, vocab, (rows, T)).astype(np.int32),
                        attention_mask=np.ones((rows, T), np.int32), response_mask=mask,
                        logp_infer=np.where(mask > 0, -2.0, 0.0).astype(np.float32),
                        rewards=rng.integers(0, 2, rows).astype(np.float32))


def step_seconds(state: PPOState, batch: RolloutBatch, config: PPOConfig, repeats: int) -> float:
    """Best time of one training step: the θ_old scoring pass and `ppo_step` (groups of 4)."""
    score = jax.jit(score_batch)
    step = jax.jit(functools.partial(ppo_step, config=config, group_size=4))

    def one_step():
        _, metrics = step(state, score(state, batch))
        jax.block_until_ready(metrics)
    return best_time(one_step, repeats)


def gib(tree) -> float:
    return float(sum(x.nbytes for x in jax.tree.leaves(tree))) / 2**30


def measure(name: str, repeats: int) -> dict:
    policy = policy_of(name)
    batch = batch_of(policy.config.vocab_size, *SHAPES[name])
    config = PPOConfig(advantage="grpo")
    tx = lambda: make_optimizer(OptimizerConfig(learning_rate=1e-6))  # noqa: E731
    out = {}
    for label, critic in (("with critic", ValueModel.from_policy(policy, key=jax.random.key(1))), ("critic-free", None)):
        state = PPOState.create(policy, critic, tx(), None if critic is None else tx())
        seconds = step_seconds(state, batch, config, repeats)
        out[label] = {"weights_gib": gib((state.policy, state.critic)),
                      "optimizer_gib": gib((state.policy_opt, state.critic_opt)),
                      "held_gib": gib(state), "step_s": seconds}
    out["held_ratio"] = out["critic-free"]["held_gib"] / out["with critic"]["held_gib"]
    out["step_speedup"] = out["with critic"]["step_s"] / out["critic-free"]["step_s"]
    out["shape"] = dict(zip(("rows", "prompt", "response"), SHAPES[name]))
    return out


def model_arguments(doc: str) -> argparse.Namespace:
    """--models (of SHAPES) and --repeats, the arguments of this benchmark and bench_bypass.py."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["quickstart", "smollm2"], choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def main() -> None:
    args = model_arguments(__doc__)
    results = measure_models(measure, args.models, args.repeats, ROOT / "benchmarks" / "results" / "critic_free.json")
    print("| model | state | weights GiB | optimizer GiB | held GiB | step s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in results["models"].items():
        for label in ("with critic", "critic-free"):
            x = r[label]
            print(f"| {name} | {label} | {x['weights_gib']:.4f} | {x['optimizer_gib']:.4f} | {x['held_gib']:.4f} | "
                  f"{x['step_s']:.3f} |")
        print(f"| {name} | ratio | | | {r['held_ratio']:.2f}× held | {r['step_speedup']:.2f}× faster |")


if __name__ == "__main__":
    main()
