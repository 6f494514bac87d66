"""The merge's report: held-out accuracy per domain of the base, each expert on its own domains,
the student on every domain and the weight-space baselines, all through one evaluator (same
prompts, greedy, same engine precision and verifiers), plus the wall time of every phase.

report.json: {"domains": {name: {"base", "expert", "student", "weight_average", "task_arithmetic"}},
              "mean": {column: mean over domains}, "student_over_expert": {name: ratio},
              "task_arithmetic_scale": λ, "wall_time_s": {phase: seconds}, the merge's settings
              (loss, divergence, balance, grow, teacher_samples, student_parameters), teachers_gib
              (what local teachers held: LoRA experts on one base hold it once), ...}
report.md: the same as a table.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from opd_jax.config.opd_pipeline import MergeConfig
from opd_jax.core.weight_space import average_weights, task_arithmetic
from opd_jax.data import validation_prompts
from opd_jax.merge.plan import MergePlan
from opd_jax.merge.teachers import load_teacher
from opd_jax.models import Decoder, Tokenizer
from opd_jax.train import HeldOutEvaluator, build_model, held_out_evaluator

COLUMNS = ("base", "expert", "student", "weight_average", "task_arithmetic")


def _same_architecture(models: list[Decoder]) -> bool:
    graphdefs = {nnx.split(m, nnx.Param)[0] for m in models}
    return len(graphdefs) == 1


def _baselines(config: MergeConfig, plan: MergePlan, base: Decoder, experts: list[Decoder], tokenizer: Tokenizer,
               evaluator: HeldOutEvaluator) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """Held-out accuracy of the experts averaged and of task arithmetic at the scale that does
    best on validation prompts; notes say what was chosen or why a baseline was skipped."""
    options = config.baselines
    if not (options.weight_average or options.task_arithmetic):
        return {}, {}
    if not _same_architecture([base, *experts]):
        return {}, {"baselines": "skipped: the experts and the base differ in architecture, so their weights "
                                 "cannot be merged"}
    graphdef, base_params = nnx.split(base, nnx.Param)
    expert_params = [nnx.split(m, nnx.Param)[1] for m in experts]
    out, notes = {}, {}
    if options.weight_average:
        out["weight_average"] = evaluator(nnx.merge(graphdef, average_weights(expert_params)))
    if options.task_arithmetic:
        validation = held_out_evaluator(tokenizer, base, config.rollout, plan.data,
                                        held_out=validation_prompts(plan.data, options.validation_prompts_per_domain))
        try:
            scores = {scale: float(np.mean(list(validation(
                nnx.merge(graphdef, task_arithmetic(base_params, expert_params, scale))).values())))
                for scale in options.task_arithmetic_scales}
        finally:
            validation.close()
        best = max(scores, key=scores.get)
        notes["task_arithmetic_scale"] = best
        notes["task_arithmetic_validation"] = {str(k): v for k, v in scores.items()}
        out["task_arithmetic"] = evaluator(nnx.merge(graphdef, task_arithmetic(base_params, expert_params, best)))
    return out, notes


def build_report(config: MergeConfig, plan: MergePlan, student: Decoder, tokenizer: Tokenizer,
                 phases: dict[str, float]) -> dict[str, Any]:
    evaluator = held_out_evaluator(tokenizer, student, config.rollout, plan.data)
    try:
        began = time.perf_counter()
        base, _ = build_model(plan.student)
        columns: dict[str, dict[str, float]] = {"base": evaluator(base), "student": evaluator(student), "expert": {}}
        experts = []
        for spec in plan.teachers:
            model, _ = load_teacher(spec.name, spec.path, config.teachers.dtype)
            experts.append(model)
            columns["expert"].update(evaluator(model, [d for d in spec.domains if d in evaluator.held_out]))
        phases["report: evaluation"] = time.perf_counter() - began
        began = time.perf_counter()
        baselines, notes = _baselines(config, plan, base, experts, tokenizer, evaluator)
        columns.update(baselines)
        phases["report: baselines"] = time.perf_counter() - began
    finally:
        evaluator.close()
    domains = sorted(evaluator.held_out)
    table = {d: {c: columns[c][d] for c in COLUMNS if c in columns and d in columns[c]} for d in domains}
    wall = {}
    if plan.base is not None:
        wall["base"] = plan.base["wall_time_s"]
    if plan.experts:
        wall.update({f"expert/{n}": e["wall_time_s"] for n, e in plan.experts.items()})
        wall["experts"] = sum(e["wall_time_s"] for e in plan.experts.values())
    wall.update({f"merge/{k}": v for k, v in phases.items()})
    wall["merge"] = sum(phases.values())
    wall["pipeline"] = wall.get("base", 0.0) + wall.get("experts", 0.0) + wall["merge"]
    return {
        "domains": table,
        "mean": {c: float(np.mean([row[c] for row in table.values()])) for c in COLUMNS
                 if table and all(c in row for row in table.values())},
        "student_over_expert": {d: row["student"] / row["expert"] if row.get("expert") else None
                                for d, row in table.items() if "expert" in row},
        **notes,
        "teachers": {t.name: {"model": str(t.path), "domains": list(t.domains)} for t in plan.teachers},
        "steps": config.steps, "loss": config.opd.loss, "reward_alpha": config.opd.reward_alpha,
        "divergence": config.opd.divergence if config.opd.loss != "sampled" else "reverse_kl (sampled)",
        "balance": config.balance.enabled,
        "grow": config.grow.model_dump() if config.grow.num_layers or config.grow.intermediate_size else None,
        "teacher_samples": ({"fraction": config.teacher_samples.fraction,
                             "warmup_steps": config.teacher_samples.warmup.steps}
                            if config.teacher_samples.enabled else None),
        "student_parameters": int(sum(x.size for x in jax.tree.leaves(nnx.state(student, nnx.Param)))),
        "wall_time_s": wall,
    }


def markdown_table(report: dict[str, Any]) -> str:
    """The per-domain table (and the means) as Markdown."""
    columns = [c for c in COLUMNS if any(c in row for row in report["domains"].values())]
    lines = ["| domain | " + " | ".join(c.replace("_", " ") for c in columns) + " | student / expert |",
             "| --- |" + " ---: |" * (len(columns) + 1)]
    for domain, row in report["domains"].items():
        ratio = report["student_over_expert"].get(domain)
        lines.append(f"| {domain} | " + " | ".join(f"{row[c]:.2f}" if c in row else "" for c in columns)
                     + f" | {'' if ratio is None else f'{ratio:.2f}'} |")
    mean = report["mean"]
    lines.append("| **mean** | " + " | ".join(f"**{mean[c]:.2f}**" if c in mean else "" for c in columns) + " | |")
    return "\n".join(lines) + "\n"


def write_report(config: MergeConfig, plan: MergePlan, student: Decoder, tokenizer: Tokenizer,
                 phases: dict[str, float], run_dir: Path, *, teachers_bytes: int | None = None) -> dict[str, Any]:
    """report.json and report.md; `teachers_bytes`: what local teachers held on the mesh (None:
    served elsewhere), reported as teachers_gib."""
    report = {**build_report(config, plan, student, tokenizer, phases),
              "teachers_gib": None if teachers_bytes is None else teachers_bytes / 2**30}
    (run_dir / "report.json").write_text(json.dumps(report, indent=2))
    (run_dir / "report.md").write_text(markdown_table(report))
    return report
