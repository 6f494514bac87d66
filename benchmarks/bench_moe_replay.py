"""Routing flips and the train/inference mismatch of the MoE quickstart, with and without routing
replay (R3), side by side with the dense quickstart at the same size.

Per seed, each model (configs/quickstart.yaml, dense; configs/quickstart_moe.yaml, 8 experts
top-2) gets its supervised warm start once (`opd-jax sft`); every PPO run of that seed starts from
it, with a bfloat16 engine against the float32 trainer, alone and with the engine's weights
perturbed (rollout.inject_weight_noise, for a mismatch large enough to flip routes). Each run's
figures are means over its steps: the fraction of response tokens whose top-k expert set differs
between engine and trainer (policy/moe/flip_frac), the mean |log π_engine − log π_trainer(θ_old)|
and the fraction of tokens outside IcePop's band. Reported as mean and 95% t-interval over seeds.

usage: python benchmarks/bench_moe_replay.py [--seeds 0 1 2] [--steps 40] [--out runs/bench_moe_replay]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from bench_common import machine, t_interval

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"dense": "quickstart.yaml", "moe": "quickstart_moe.yaml"}
# (model, engine weight noise, routing replay)
SETTINGS = [("dense", 0.0, "none"), ("moe", 0.0, "none"), ("moe", 0.0, "r3"),
            ("dense", 0.05, "none"), ("moe", 0.05, "none"), ("moe", 0.05, "r3")]
FIGURES = {"flip": "policy/moe/flip_frac", "dlogp": "mismatch_abs_logp_diff", "outside": "mismatch_outside_band_frac"}


def opd_jax(*args: str) -> float:
    began = time.perf_counter()
    subprocess.run([sys.executable, "-m", "opd_jax.cli", *args, "logging.progress_bar=false"], check=True)
    return time.perf_counter() - began


def seeded(seed: int) -> list[str]:
    return [f"seed={seed}", f"model.fresh.seed={seed}", f"data.seed={seed}"]


def run_setting(out: Path, seed: int, model: str, noise: float, replay: str, steps: int) -> dict:
    run_dir = out / f"{model}_noise{noise}_{replay}_seed{seed}"
    wall = opd_jax("train", str(ROOT / "configs" / MODELS[model]), f"seed={seed}", f"data.seed={seed}",
                   "model.fresh=null", f"model.path={out / f'sft_{model}_seed{seed}' / 'sft_policy'}", "sft.steps=0",
                   f"steps={steps}", "rollout.dtype=bfloat16", f"rollout.inject_weight_noise={noise}",
                   f"algorithm.ppo.routing_replay={replay}", "logging.eval_at_start=false",
                   f"logging.eval_every={steps}", f"checkpoint.every={steps}", f"logging.run_dir={run_dir}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_rows = [r for r in rows if FIGURES["dlogp"] in r]
    return {name: float(np.mean([r.get(key, 0.0) for r in steps_rows])) for name, key in FIGURES.items()} | {
        "wall_s": wall, "steps": len(steps_rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_moe_replay")
    args = parser.parse_args()
    if args.out.exists():
        sys.exit(f"error: {args.out} exists; remove it or pass --out")
    results: dict[tuple, list[dict]] = {s: [] for s in SETTINGS}
    for seed in args.seeds:
        for model, config in MODELS.items():
            opd_jax("sft", str(ROOT / "configs" / config), *seeded(seed),
                    f"logging.run_dir={args.out / f'sft_{model}_seed{seed}'}")
        for setting in SETTINGS:
            results[setting].append(run_setting(args.out, seed, *setting, args.steps))
    print(f"\n{machine()}; seeds {args.seeds}, {args.steps} PPO steps per run from each seed's warm start; "
          "bf16 engine, f32 trainer; mean [95% t-interval] over seeds of each run's per-step mean\n")
    print("| model | engine | replay | routing flips | mean abs(Δlogp) | outside IcePop band |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    summary = []
    for (model, noise, replay), runs in results.items():
        cells, row = [], {"model": model, "noise": noise, "replay": replay, "runs": runs}
        for name in FIGURES:
            mean, low, high = t_interval([r[name] for r in runs])
            row[name] = {"mean": mean, "ci95": [low, high]}
            cells.append(f"{mean:.4f} [{low:.4f}, {high:.4f}]" if not (model == "dense" and name == "flip") else "n/a")
        engine = "bf16" if noise == 0 else f"bf16 + noise {noise}"
        print(f"| {model} | {engine} | {replay} | {' | '.join(cells)} |")
        summary.append(row)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nwritten to {args.out / 'summary.json'}")


if __name__ == "__main__":
    main()
