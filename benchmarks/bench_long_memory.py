"""Memory of one PPO step at growing sequence length, through `opd-jax plan` (compiled ahead of
time on abstract arrays, nothing allocated, so lengths no machine here holds are measured):
benchmarks/long_sequences.yaml, a Qwen3-0.6B-shaped policy and its critic (28 layers, hidden 1024,
16 query and 8 key heads of 128, vocabulary 151,936), Adam, one sequence, one device, float32.
Each setting is a set of `model.*` overrides (docs/long_sequences.md): plain (dense attention,
whole logits, no remat: the trainer before issue 47) against the long-sequence knobs. The same
figure for one length and setting: `opd-jax plan benchmarks/long_sequences.yaml --tokens N KEY=VALUE...`.
--sequence S1 S2 ...: each setting also on S simulated devices with the sequence split over them
(context parallelism: `mesh.data=1 mesh.sequence=S`), per-device bytes.

usage: python benchmarks/bench_long_memory.py [--lengths 512 1024 ...] [--settings plain defaults ...]
       [--sequence 1 8]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from opd_jax.config import TrainConfig, load_config
from opd_jax.train.plan import GIB, plan_devices, plan_train

CONFIG = Path(__file__).with_name("long_sequences.yaml")
SETTINGS = {
    "plain": ["model.attention=dense", f"model.logits_chunk={1 << 30}", "model.remat=none"],
    "defaults": [],  # blockwise attention, logits in chunks, remat auto
    "no remat": ["model.remat=none"],
    "remat dots": ["model.remat=dots"],
    "remat full": ["model.remat=full"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--sequence", type=int, nargs="+", default=[1])
    args = parser.parse_args()
    devices = plan_devices(max(args.sequence))
    print("PPO step (policy + critic, Adam, state donated), batch 1, float32, XLA:CPU; GiB per device")
    print("| setting | sequence shards | tokens | temporaries | × per doubling | arguments (state, batch) | peak "
          "| compile s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.settings:
        for shards in args.sequence:
            overrides = [*SETTINGS[name], "mesh.data=1", f"mesh.sequence={shards}"]
            previous = None
            for length in args.lengths:
                began = time.perf_counter()
                config = load_config(CONFIG, overrides, schema=TrainConfig)
                step = plan_train(config, devices[:shards], length).programs[0]
                growth = "" if previous is None else f"{step.temporaries / previous:.2f}"
                previous = step.temporaries
                print(f"| {name} | {shards} | {length} | {step.temporaries / GIB:.2f} | {growth} | "
                      f"{step.arguments / GIB:.2f} | {step.peak / GIB:.2f} | {time.perf_counter() - began:.0f} |",
                      flush=True)


if __name__ == "__main__":
    main()
