"""The OPD merge headline over seeds: the `report.json` of several `opd-jax recipe` runs (one per
seed) as one table, each domain's held-out accuracy (base, expert, student, baselines) and the
student's share of its expert as a mean over the seeds with a Student-t 95% interval
(`opd_jax.sweep.stats.interval`), the domains each seed keeps at 95%, and the wall times.

    python benchmarks/opd_merge_seeds.py RUN_DIR [RUN_DIR ...] [--out benchmarks/results/opd_merge_seeds.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from opd_jax.sweep.stats import interval

COLUMNS = ("base", "expert", "student", "weight_average", "task_arithmetic")
KEEP = 0.95


def aggregate(reports: dict[str, dict]) -> dict:
    domains = sorted(next(iter(reports.values()))["domains"])
    table = {}
    for d in domains:
        rows = [r["domains"][d] for r in reports.values()]
        table[d] = {c: interval([row[c] for row in rows]) for c in COLUMNS if all(c in row for row in rows)}
        # no ratio where the expert scores 0 (the report leaves it out): that seed neither keeps nor loses it
        ratios = [r["student_over_expert"][d] for r in reports.values() if r["student_over_expert"][d] is not None]
        table[d]["student_over_expert"] = interval(ratios)
        table[d]["seeds_kept"] = sum(x >= KEEP for x in ratios)
        table[d]["seeds_with_ratio"] = len(ratios)
    means = {c: interval([r["mean"][c] for r in reports.values()]) for c in COLUMNS}
    walls = [r["recipe_wall_time_s"]["total"] for r in reports.values()]
    return {"runs": list(reports), "seeds": len(reports), "domains": table, "mean": means,
            "domains_kept_per_seed": {run: r["domains_kept"] for run, r in reports.items()},
            "recipe_wall_time_s": {"per_run": dict(zip(reports, walls)), **interval(walls)}}


def markdown(result: dict) -> str:
    ci = lambda s: f"{s['mean']:.2f} [{s['low']:.2f}, {s['high']:.2f}]"  # noqa: E731
    lines = ["| domain | base | expert | student | weight average | task arithmetic | student / expert | seeds ≥ 95% |",
             "| --- |" + " ---: |" * 7]
    for d, row in result["domains"].items():
        lines.append(f"| {d} | " + " | ".join(ci(row[c]) if c in row else "" for c in COLUMNS)
                     + f" | {ci(row['student_over_expert']) if row['seeds_with_ratio'] else '–'} | "
                     f"{row['seeds_kept']}/{row['seeds_with_ratio']} |")
    lines.append("| **mean** | " + " | ".join(f"**{ci(result['mean'][c])}**" for c in COLUMNS) + " | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    reports = {str(run): json.loads((run / "report.json").read_text()) for run in args.runs}
    result = aggregate(reports)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    print(markdown(result))


if __name__ == "__main__":
    main()
