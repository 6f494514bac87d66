"""`opd-jax recipe`: the whole OPD merge in one command, resumable at any point.

    [1/3] experts            `run_experts`: the base and every expert into RUN_DIR/experts (finished ones kept, interrupted
                             ones continued from their last checkpoint)
    [2/3] merge              `merge` into RUN_DIR/merge (continued from its last checkpoint, or
                             only its export and report finished, or skipped when done)
    [3/3] report             RUN_DIR/report.md, report.json and report.png from the merge's report

    RUN_DIR/recipe.json      each phase's wall time, summed over the attempts that ended it or
                             failed in it (a killed attempt's time in its phase is not counted)

A kill at any moment, then the same command, finishes the work without redoing finished phases:
each phase keeps what it finished, and the report is rebuilt from files.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from opd_jax.config import RecipeConfig
from opd_jax.errors import OpdJaxError
from opd_jax.merge.experts import ExpertsError, expert_dir, run_experts
from opd_jax.merge.loop import merge
from opd_jax.merge.report import markdown_table
from opd_jax.train import checkpoint_steps, run_status, say, write_json

PHASES = ("experts", "merge", "report")
KEEP = 0.95  # the headline's bar: the student keeps this share of its expert on a domain


class RecipeError(OpdJaxError, RuntimeError):
    """A phase of the recipe that could not finish; names it, and what is kept."""


class _Ledger:
    """RUN_DIR/recipe.json: wall time per phase summed over attempts, which phases are done, and
    how many attempts there were."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "recipe.json"
        self.data: dict[str, Any] = {"wall_time_s": {}, "done": [], "attempts": 0}
        if self.path.exists():
            self.data.update(json.loads(self.path.read_text()))
        self.data["attempts"] += 1
        self._write()

    def add(self, phase: str, seconds: float, done: bool) -> None:
        self.data["wall_time_s"][phase] = self.data["wall_time_s"].get(phase, 0.0) + seconds
        if done and phase not in self.data["done"]:
            self.data["done"].append(phase)
        self._write()

    def _write(self) -> None:
        write_json(self.path, self.data)


def _phase(ledger: _Ledger, number: int, name: str, what: str) -> float:
    say(f"[{number}/{len(PHASES)}] {name}: {what}" + (" (done before)" if name in ledger.data["done"] else ""))
    return time.perf_counter()


def run_recipe(config: RecipeConfig) -> Path:
    """Every phase of the recipe that is not done yet; returns RUN_DIR, with report.md."""
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ledger = _Ledger(run_dir)

    began = _phase(ledger, 1, "experts", f"base and {len(config.domains)} experts in {run_dir / 'experts'}")
    try:
        run_experts(config.experts_config())
    except ExpertsError as e:
        ledger.add("experts", time.perf_counter() - began, done=False)
        raise RecipeError(f"{e}\n{_merge_refusal(config)}") from None
    ledger.add("experts", time.perf_counter() - began, done=True)

    merge_dir = Path(config.merge.logging.run_dir)
    began = _phase(ledger, 2, "merge", f"the experts into one student in {merge_dir}")
    if run_status(merge_dir) != "finished":
        merge(config.merge_config(), resume=bool(checkpoint_steps(merge_dir)))
    ledger.add("merge", time.perf_counter() - began, done=True)

    began = _phase(ledger, 3, "report", str(run_dir / "report.md"))
    report = write_recipe_report(config, ledger.data["wall_time_s"])
    ledger.add("report", time.perf_counter() - began, done=True)
    say(report)
    return run_dir


def _merge_refusal(config: RecipeConfig) -> str:
    """Why the merge will not start: the experts it is missing (the finished ones are kept)."""
    root = config.experts_config().run_dir
    missing = [n for n in config.domains if not (expert_dir(root, n) / "expert.json").exists()]
    return (f"the merge needs every domain's expert and will not start: missing {', '.join(missing)} (the finished "
            f"experts are kept; fix the failed job, then run the same command again)")


def write_recipe_report(config: RecipeConfig, wall: dict[str, float]) -> str:
    """RUN_DIR/report.json (the merge's report, the keep ratios, the recipe's wall time),
    report.md (table, which domains keep 95% of their expert, wall time, plot) and report.png;
    returns the Markdown."""
    run_dir = Path(config.run_dir)
    merged = json.loads((Path(config.merge.logging.run_dir) / "report.json").read_text())
    ratios = {d: r for d, r in merged["student_over_expert"].items() if r is not None}
    below = sorted(d for d, r in ratios.items() if r < KEEP)
    unscored = sorted(set(merged["student_over_expert"]) - set(ratios))
    report = {**merged, "recipe_wall_time_s": {**wall, "total": sum(wall.values())},
              "domains_kept": len(ratios) - len(below), "domains_below": below}
    (run_dir / "report.json").write_text(json.dumps(report, indent=2))
    _plot(merged, run_dir / "report.png")
    minutes = lambda s: f"{s / 60:.1f} min"  # noqa: E731
    text = "\n".join([
        f"# OPD recipe: {len(config.domains)} domains merged into one student", "",
        "Held-out accuracy per domain (greedy): the base, each domain's expert, the merged student and "
        "the weight-space baselines.", "",
        markdown_table(merged).rstrip(), "",
        f"The student keeps at least {KEEP:.0%} of its expert on {len(ratios) - len(below)} of {len(ratios)} "
        f"domains" + (f"; below: {', '.join(f'{d} ({ratios[d]:.2f})' for d in below)}" if below else "")
        + (f" (no ratio where the expert scores 0: {', '.join(unscored)})" if unscored else "") + ".", "",
        "Wall time (summed over every attempt): " + ", ".join(f"{p} {minutes(wall.get(p, 0.0))}" for p in PHASES[:2])
        + f", total {minutes(sum(wall.values()))}.", "",
        "![per domain](report.png)", ""])
    (run_dir / "report.md").write_text(text)
    return text


def _plot(merged: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    domains = list(merged["domains"])
    columns = [c for c in ("base", "expert", "student", "weight_average", "task_arithmetic")
               if any(c in row for row in merged["domains"].values())]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(domains) + 2), 3.6))
    width = 0.8 / len(columns)
    for i, column in enumerate(columns):
        values = [merged["domains"][d].get(column, np.nan) for d in domains]
        ax.bar(np.arange(len(domains)) + (i - (len(columns) - 1) / 2) * width, values, width, label=column.replace("_", " "))
    ax.set_xticks(np.arange(len(domains)), domains, rotation=30, ha="right")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize="small", ncol=len(columns), loc="upper center", bbox_to_anchor=(0.5, 1.18))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
