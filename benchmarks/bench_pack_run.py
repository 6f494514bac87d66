"""Is packing worth its compiles over a whole run? One config trained end to end (in process) with
`algorithm.ppo.update.pack` and `sft.pack` off, on and auto, the same seed each time; per mode:
wall time, the warm start's and the RL steps' time, and how many XLA compilations the run did and
how long they took (jax.monitoring's backend-compile events, all of them: steps, scoring, sampler,
evaluation). The rollouts are the same in every mode (same seed, and packing does not change the
numbers beyond float rounding), so the modes differ only in how the forwards lay out the batch.

usage: python benchmarks/bench_pack_run.py [--config C] [--modes false true auto] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
from bench_common import machine

ROOT = Path(__file__).resolve().parent.parent
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart_agent.yaml")
    parser.add_argument("--modes", nargs="+", default=["false", "true", "auto"])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "pack_run.json")
    parser.add_argument("overrides", nargs="*", help="config overrides for every mode, e.g. steps=20")
    args = parser.parse_args()

    from opd_jax.config import load_config
    from opd_jax.train import train

    compiles: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: compiles.append(seconds) if event == _COMPILE_EVENT else None)
    jax.config.update("jax_enable_compilation_cache", False)  # every mode compiles from scratch
    results = []
    for mode in args.modes:
        with tempfile.TemporaryDirectory() as run_dir:
            config = load_config(args.config, [*args.overrides, f"algorithm.ppo.update.pack={mode}",
                                               f"sft.pack={mode}", f"logging.run_dir={run_dir}",
                                               "logging.progress_bar=false", "logging.tensorboard=false",
                                               "logging.plot=false", "checkpoint.export_hf=false"])
            compiles.clear()
            jax.clear_caches()
            began = time.perf_counter()
            train(config)
            wall = time.perf_counter() - began
            phases = json.loads((Path(run_dir) / "wall_time.json").read_text())
        results.append({"pack": mode, "wall_s": wall, "phases_s": phases, "compiles": len(compiles),
                        "compile_s": sum(compiles)})
        print(json.dumps(results[-1]), flush=True)
    base = results[0]["wall_s"]
    for r in results:
        r["wall_vs_first"] = r["wall_s"] / base
    report = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "config": str(args.config),
              "overrides": args.overrides, "command": " ".join(sys.argv), "runs": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    for r in results:
        print(f"pack={r['pack']:5s} wall {r['wall_s']:7.1f} s ({r['wall_vs_first']:.2f}x)  "
              f"compiles {r['compiles']:3d} ({r['compile_s']:.1f} s)  phases {r['phases_s']}")


if __name__ == "__main__":
    main()
