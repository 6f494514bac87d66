"""Speed of the PPO step (policy + critic, Adam) at short lengths under the long-sequence knobs,
side by side in one run: `before` (dense attention, whole logits, no remat: the trainer before
issue 47), the defaults (attention auto, logits in chunks of 2048, remat auto) and remat full.
Each workload is a config's real model (random batch of its shape); the step is the runner's
(`sharded_step` on one device, the state donated); best of `--repeats` after a warm-up.

usage: python benchmarks/bench_long_speed.py [--workloads quickstart smollm2 ...] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import numpy as np
from bench_common import best_time, machine

from opd_jax.config import TrainConfig, load_config
from opd_jax.core import RolloutBatch
from opd_jax.parallel import make_mesh, shard, sharded_scoring, sharded_step, tree_shardings
from opd_jax.train.build import add_configured_adapters, build_model
from opd_jax.train.loop import PPOTask

CONFIGS = Path(__file__).parents[1] / "configs"
WORKLOADS = {  # name: (config, rows, tokens, overrides)
    "quickstart": (CONFIGS / "quickstart.yaml", 64, 24, []),
    "smollm2": (CONFIGS / "smollm2_word_problems.yaml", 4, 256, []),
    "smollm2-1k": (CONFIGS / "smollm2_word_problems.yaml", 1, 1024, ["algorithm.ppo.update.microbatches=1"]),
}
SETTINGS = {
    "before": ["model.attention=dense", f"model.logits_chunk={1 << 30}", "model.remat=none"],
    "defaults": [],
    "remat full": ["model.remat=full"],
}


def step_seconds(config_path: Path, overrides: list[str], rows: int, tokens: int, repeats: int) -> float:
    config = load_config(config_path, ["sft.steps=0", *overrides], schema=TrainConfig)
    task = PPOTask(config)
    task.policy = add_configured_adapters(build_model(config.model)[0], config.model, config.seed)
    mesh = make_mesh(config.mesh, jax.devices()[:1])
    state = task.create_state()
    state = shard(state, tree_shardings(state, mesh))
    rng = np.random.default_rng(0)
    half = tokens // 2
    batch = RolloutBatch(tokens=rng.integers(0, task.vocab_size, (rows, tokens)).astype(np.int32),
                         attention_mask=np.ones((rows, tokens), np.int32),
                         response_mask=np.concatenate([np.zeros((rows, half)), np.ones((rows, tokens - half))],
                                                      1).astype(np.float32),
                         logp_infer=np.full((rows, tokens), -1.0, np.float32),
                         rewards=rng.integers(0, 2, rows).astype(np.float32))
    scored = sharded_scoring(task.scoring_fn, state, batch, mesh)(state, batch)
    step = sharded_step(task.step_fn, state, scored, mesh)
    holder = {"state": state}

    def once():
        holder["state"], metrics = step(holder["state"], scored)
        jax.block_until_ready(metrics)
    return best_time(once, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{machine()}; {time.strftime('%Y-%m-%d')}; PPO step seconds, best of {args.repeats}")
    print("| workload | rows × tokens | " + " | ".join(SETTINGS) + " | defaults / before |")
    print("| --- | --- | " + " | ".join("---:" for _ in SETTINGS) + " | ---: |")
    for name in args.workloads:
        path, rows, tokens, overrides = WORKLOADS[name]
        seconds = {s: step_seconds(path, [*overrides, *o], rows, tokens, args.repeats) for s, o in SETTINGS.items()}
        print(f"| {name} | {rows} × {tokens} | " + " | ".join(f"{t:.3f}" for t in seconds.values())
              + f" | {seconds['defaults'] / seconds['before']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
