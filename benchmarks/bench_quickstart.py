"""Does the quickstart's RL phase raise held-out accuracy? `configs/quickstart.yaml` (or --config,
e.g. the multi-turn `configs/quickstart_agent.yaml`) run end to end as a user runs it (`opd-jax
train`) once per seed; the seed moves everything random (model init, prompt streams, samples).
The gain is the final held-out accuracy (an environment's: its success rate) minus the accuracy
right after the warm start (step 0), per seed; reported as mean with a two-sided 95% t-interval
over seeds.

usage: python benchmarks/bench_quickstart.py [--config C] [--seeds 0 1 2] [--out DIR] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from bench_common import t_interval

ROOT = Path(__file__).resolve().parent.parent


def run_seed(seed: int, out: Path, overrides: list[str], config: Path) -> dict:
    run_dir = out / f"seed{seed}"
    command = [sys.executable, "-m", "opd_jax.cli", "train", str(config),
               f"seed={seed}", f"model.fresh.seed={seed}", f"data.seed={seed}", f"logging.run_dir={run_dir}",
               "logging.progress_bar=false", *overrides]
    began = time.perf_counter()
    subprocess.run(command, check=True)
    wall = time.perf_counter() - began
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval/accuracy" in r]
    first, last = evals[0], evals[-1]
    assert first["step"] == 0, "the quickstart must evaluate before RL (logging.eval_at_start)"
    domains = sorted(k.split("/")[1] for k in last if k.startswith("eval/") and k.count("/") == 2
                     and k.endswith("/accuracy"))
    return {"seed": seed, "wall_s": wall, "phases_s": json.loads((run_dir / "wall_time.json").read_text()),
            "before": {d: first[f"eval/{d}/accuracy"] for d in domains} | {"all": first["eval/accuracy"]},
            "after": {d: last[f"eval/{d}/accuracy"] for d in domains} | {"all": last["eval/accuracy"]},
            "final_step": last["step"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_quickstart")
    parser.add_argument("overrides", nargs="*", help="config overrides applied to every seed")
    args = parser.parse_args()
    if args.out.exists():
        sys.exit(f"error: {args.out} exists; remove it or pass --out")
    runs = [run_seed(s, args.out, args.overrides, args.config) for s in args.seeds]
    keys = list(runs[0]["after"])
    print(f"\n{args.config.name} over seeds {args.seeds} ({len(runs)} runs), held-out accuracy after the warm start (step 0) "
          f"and after RL (step {runs[0]['final_step']}); gain: mean and 95% t-interval over seeds\n")
    print("| held-out | after SFT | after RL | gain [95% CI] | gain per seed |")
    print("| --- | ---: | ---: | ---: | --- |")
    summary = {}
    for k in keys:
        gains = [r["after"][k] - r["before"][k] for r in runs]
        mean, low, high = t_interval(gains)
        summary[k] = {"before": float(np.mean([r["before"][k] for r in runs])),
                      "after": float(np.mean([r["after"][k] for r in runs])), "gain": mean, "ci95": [low, high],
                      "gains": gains}
        print(f"| {k} | {summary[k]['before']:.3f} | {summary[k]['after']:.3f} | {mean:+.3f} [{low:+.3f}, {high:+.3f}] "
              f"| {', '.join(f'{g:+.3f}' for g in gains)} |")
    walls = [r["wall_s"] for r in runs]
    print(f"\nwall time per run: {', '.join(f'{w:.0f} s' for w in walls)} (mean {np.mean(walls):.0f} s)")
    (args.out / "summary.json").write_text(json.dumps({"runs": runs, "summary": summary}, indent=2))
    print(f"written to {args.out / 'summary.json'}")


if __name__ == "__main__":
    main()
