"""Multi-turn episode throughput of each engine, side by side on the same work: `opd-jax train` on
one built-in environment with the embedded engine (static: the episodes' turns in rounds, one
batch per round; continuous: rollout.decode_slots=32, each turn joins the decode batch as soon as
its episode sends it) and with a launched sglang-jax server (f32, the same policy: a fresh
quickstart-sized model with head_dim 128, which sglang-jax's CPU attention needs), the same seeds
and settings. Episodes per second and model tokens per second
are the step's episodes and generated tokens over its rollout wait (generation only; the server's
refit-by-restart is timed apart), per step after the first (which compiles), median over steps.

usage: python benchmarks/bench_episodes.py [--envs search calculator gridworld] [--engines embedded continuous sglang]
                                          [--steps 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml
from bench_common import machine

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from rollout_bridge import sglang_jax  # noqa: E402

MODEL = ["model.fresh.hidden_size=256", "model.fresh.intermediate_size=512", "model.fresh.num_layers=2",
         "model.fresh.num_heads=2", "model.fresh.num_kv_heads=1", "model.fresh.head_dim=128"]
ENVS = {"search": "{hi: 15, max_guesses: 6}", "calculator": "{max_calls: 6}", "gridworld": "{max_moves: 24}"}


def run(out: Path, env: str, engine: str, steps: int, extra: list[str]) -> dict:
    run_dir = out / f"{env}-{engine}"
    config = ROOT / "configs" / "quickstart.yaml"
    if engine.endswith("-nocache"):  # the embedded engine without its prefix cache
        engine, extra = engine.removesuffix("-nocache"), ["rollout.prefix_cache_gib=0", *extra]
    if engine == "continuous":
        extra = ["rollout.decode_slots=32", *extra]
    if engine == "sglang":
        data = yaml.safe_load(config.read_text())
        data["rollout"].update({"engine": "sglang", "sglang": {"launch": {
            "command": sglang_jax.command(sglang_jax.python(), max_running_requests=64), "env": sglang_jax.ENV}}})
        config = out / "sglang.yaml"
        config.write_text(yaml.safe_dump(data))
    command = [sys.executable, "-m", "opd_jax.cli", "train", str(config), *MODEL, f"steps={steps}", "sft.steps=0",
               f"data.train=[{{environment: {env}, params: {ENVS[env]}}}]", "data.prompts_per_step=8",
               "rollout.samples_per_prompt=4", "rollout.max_new_tokens=16", "rollout.episodes.max_tokens=512",
               "logging.eval_at_start=false", f"logging.eval_every={steps}", "data.eval_prompts_per_domain=8",
               "logging.progress_bar=false", "logging.tensorboard=false", "logging.plot=false",
               "checkpoint.export_hf=false", f"checkpoint.every={steps}", f"logging.run_dir={run_dir}", *extra]
    subprocess.run(command, check=True, cwd=ROOT)
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "episodes/turns" in r]
    rows = rows[1:]  # the first step compiles
    episodes = 8 * 4
    return {"episodes_per_s": float(np.median([episodes / r["rollout/wait_s"] for r in rows])),
            "model_tokens_per_s": float(np.median([r["rollout/tokens_per_s"] for r in rows])),
            "prefill_saved_frac": float(np.mean([r.get("rollout/prefill_saved_frac", 0.0) for r in rows])),
            "prefix_hit_frac": float(np.mean([r.get("rollout/prefix_hit_frac", 0.0) for r in rows])),
            "prefill_flops_saved_frac": float(np.mean([r.get("rollout/prefill_flops_saved_frac", 0.0) for r in rows])),
            "tokens_per_episode": float(np.mean([r["episodes/tokens"] for r in rows])),
            "turns_per_episode": float(np.mean([r["episodes/turns"] for r in rows])),
            "steps_measured": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", nargs="+", default=list(ENVS))
    parser.add_argument("--engines", nargs="+", default=["embedded-nocache", "embedded", "continuous-nocache",
                                                         "continuous", "sglang"],
                        choices=["embedded", "embedded-nocache", "continuous", "continuous-nocache", "sglang"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_episodes")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    results = {env: {engine: run(args.out, env, engine, args.steps, args.overrides) for engine in args.engines}
               for env in args.envs}
    print(f"\nepisode throughput, {machine()}, 32 episodes per step (8 instances x 4 samples), median over steps "
          f"2..{args.steps}; a random policy, so episodes run to their budgets\n")
    print("| environment | engine | turns / tokens per episode | episodes/s | model tokens/s | vs static, no cache |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for env, r in results.items():
        for engine, e in r.items():
            base = r.get("embedded-nocache", r.get("embedded"))
            ratio = e["episodes_per_s"] / base["episodes_per_s"] if base else float("nan")
            print(f"| {env} | {engine} | {e['turns_per_episode']:.1f} / {e['tokens_per_episode']:.0f} | "
                  f"{e['episodes_per_s']:.2f} | {e['model_tokens_per_s']:.0f} | {ratio:.2f}x |")
    (args.out / "summary.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
