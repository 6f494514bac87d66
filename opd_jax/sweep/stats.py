"""What a sweep's runs say, with their uncertainty: per cell, the held-out metric (final, best,
gain over the first evaluation) and chosen training metrics as mean with a Student's t
interval over seeds (SciPy; a training metric is first averaged over its run's steps);
paired differences between cells over the seeds both ran; per run, whether and when training
collapsed. Reads run directories, writes nothing."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats

from opd_jax.config.sweep import CollapseSection, PrimarySection


def interval(values: Sequence[float], level: float = 0.95) -> dict[str, float]:
    """{"n", "mean", "low", "high", "std"}: the mean of `values` (NaNs left out) with the two-sided
    Student's t interval at `level` (n − 1 degrees of freedom; NaN bounds below 2 values)."""
    x = np.asarray([v for v in values if v is not None and not math.isnan(v)], np.float64)
    out = {"n": int(x.size), "mean": float(x.mean()) if x.size else math.nan,
           "std": float(x.std(ddof=1)) if x.size > 1 else math.nan, "low": math.nan, "high": math.nan,
           "min": float(x.min()) if x.size else math.nan, "max": float(x.max()) if x.size else math.nan}
    if x.size > 1:
        if out["std"] == 0:
            out["low"] = out["high"] = out["mean"]
        else:
            out["low"], out["high"] = (float(b) for b in stats.t.interval(level, x.size - 1, loc=x.mean(),
                                                                         scale=stats.sem(x)))
    return out


def paired(a: dict[int, float], b: dict[int, float], level: float = 0.95, *, alternative: str = "two-sided",
           margin: float = 0.0) -> dict[str, Any]:
    """The paired difference a − b over the seeds both have: its t interval, and the p-value of a
    paired t-test of a − b against −margin (two-sided, or one-sided "greater"/"less"). Every
    difference equal: p is 1 where that equals −margin (identical cells), 0 where it is on the
    alternative's side, else 1; NaN below 2 pairs."""
    seeds = sorted(s for s in a if s in b and not (math.isnan(a[s]) or math.isnan(b[s])))
    diffs = np.asarray([a[s] - b[s] for s in seeds], np.float64) + margin
    out = {"seeds": seeds, **interval(list(diffs - margin), level), "p_value": math.nan}
    if len(seeds) < 2:
        return out
    if np.ptp(diffs) == 0:  # no spread: the t statistic is undefined; the answer is not
        d = float(diffs[0])
        side = {"two-sided": d != 0, "greater": d > 0, "less": d < 0}[alternative]
        out["p_value"] = 0.0 if side else 1.0
    else:
        out["p_value"] = float(stats.ttest_1samp(diffs, 0.0, alternative=alternative).pvalue)
    return out


def run_outcome(run: dict[str, Any], primary: PrimarySection) -> float:
    """One run's primary outcome (collapsed: 1.0 or 0.0)."""
    if primary.outcome == "collapsed":
        return float(run["collapse"]["any"] is not None)
    if primary.outcome == "last_mean":
        curve = run.get("curve") or []
        return float(np.mean([v for _, v in curve[-primary.last:]])) if curve else math.nan
    return run.get(primary.outcome, math.nan)


def primary_tests(runs: dict[str, dict[int, dict[str, Any]]], primary: PrimarySection,
                  level: float) -> list[dict[str, Any]]:
    """Each declared contrast a − b of the primary outcome: the difference with its interval (a
    paired one over the seeds both ran; collapsed: the two rates), the test's p-value, the
    corrected p-value (Bonferroni or Holm over the contrasts) and whether it is below alpha."""
    out = []
    for a, b in primary.contrasts:
        value = {cell: {s: run_outcome(r, primary) for s, r in runs[cell].items()} for cell in (a, b)}
        if primary.test == "fisher_exact":
            hits = [int(sum(value[c].values())) for c in (a, b)]
            sizes = [len(value[c]) for c in (a, b)]
            table = [[hits[0], sizes[0] - hits[0]], [hits[1], sizes[1] - hits[1]]]
            p = float(stats.fisher_exact(table, alternative=primary.alternative).pvalue) if min(sizes) else math.nan
            result = {"a": a, "b": b, "a_rate": hits[0] / max(sizes[0], 1), "b_rate": hits[1] / max(sizes[1], 1),
                      "a_count": f"{hits[0]}/{sizes[0]}", "b_count": f"{hits[1]}/{sizes[1]}", "p_value": p}
        else:
            alternative = "greater" if primary.test == "non_inferiority" else primary.alternative
            result = {"a": a, "b": b, **paired(value[a], value[b], level, alternative=alternative,
                                               margin=primary.margin if primary.test == "non_inferiority" else 0.0)}
        out.append(result)
    for result, adjusted in zip(out, _corrected([r["p_value"] for r in out], primary.correction)):
        result["p_corrected"] = adjusted
        result["rejects"] = bool(adjusted < primary.alpha)
    return out


def _corrected(p_values: list[float], method: str) -> list[float]:
    """Bonferroni (p × m) or Holm's step-down correction of m p-values, capped at 1."""
    m = len(p_values)
    if method == "none":
        return list(p_values)
    if method == "bonferroni":
        return [min(1.0, p * m) for p in p_values]
    order = sorted(range(m), key=lambda i: (math.isnan(p_values[i]), p_values[i]))
    adjusted, running = [math.nan] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def collapse(rows: Sequence[dict[str, float]], eval_metric: str, rule: CollapseSection) -> dict[str, int | None]:
    """The first step of each kind of collapse in one run's metrics rows (None: it did not):
    eval_drop (the held-out metric below its first evaluation − rule.eval_drop), grad_blowup
    (policy/grad_norm > rule.grad_norm_factor × its median over the rule.grad_norm_window steps
    before it, from the 6th step that logged it on: a spike, not the slow growth of a run that learns),
    nonfinite (a skipped non-finite update), entropy (policy/entropy < rule.entropy_floor);
    and "any": the earliest of them."""
    evals = [r for r in rows if eval_metric in r]
    out: dict[str, int | None] = {"eval_drop": None, "grad_blowup": None, "nonfinite": None, "entropy": None}
    if evals:
        start = evals[0][eval_metric]
        out["eval_drop"] = next((int(r["step"]) for r in evals[1:] if r[eval_metric] < start - rule.eval_drop), None)
    grads = [r for r in rows if "policy/grad_norm" in r]
    out["grad_blowup"] = _first_spike(grads, rule)
    out["nonfinite"] = next((int(r["step"]) for r in rows if r.get("policy/skipped_nonfinite", 0)
                             or r.get("critic/skipped_nonfinite", 0)), None)
    out["entropy"] = next((int(r["step"]) for r in rows if r.get("policy/entropy", math.inf) < rule.entropy_floor), None)
    found = [s for s in out.values() if s is not None]
    out["any"] = min(found) if found else None
    return out


def _first_spike(grads: Sequence[dict[str, float]], rule: CollapseSection) -> int | None:
    """The first step whose policy/grad_norm exceeds rule.grad_norm_factor × the median of the
    rule.grad_norm_window norms before it (from the 6th logged step on), or None."""
    norms = [r["policy/grad_norm"] for r in grads]
    for i in range(5, len(norms)):
        recent = float(np.median(norms[max(0, i - rule.grad_norm_window):i]))
        if not norms[i] <= rule.grad_norm_factor * recent:  # a NaN norm counts as a spike
            return int(grads[i]["step"])
    return None


def run_summary(rows: Sequence[dict[str, float]], eval_metric: str, metrics: Sequence[str],
                rule: CollapseSection) -> dict[str, Any]:
    """One run's figures: the held-out metric's first, final and best values and the gain
    final − first, each training metric's mean over the steps that logged it, and its collapse
    steps."""
    evals = [(int(r["step"]), r[eval_metric]) for r in rows if eval_metric in r]
    out: dict[str, Any] = {"steps": max((int(r["step"]) for r in rows), default=0)}
    if evals:
        out.update(first=evals[0][1], final=evals[-1][1], best=max(v for _, v in evals),
                   gain=evals[-1][1] - evals[0][1], first_step=evals[0][0], curve=evals)
    for name in metrics:
        logged = [r[name] for r in rows if name in r]
        out[name] = float(np.mean(logged)) if logged else math.nan
    out["collapse"] = collapse(rows, eval_metric, rule)
    return out


def cell_summary(runs: dict[int, dict[str, Any]], metrics: Sequence[str], level: float) -> dict[str, Any]:
    """Across one cell's runs (by seed): every figure's interval (the held-out metric's, wall time's
    and the training metrics'), and collapse incidence per kind (runs that collapsed / runs)."""
    out: dict[str, Any] = {}
    for name in ("first", "final", "best", "gain", "wall_s", "steps_s", *metrics):
        out[name] = interval([r.get(name, math.nan) for r in runs.values()], level)
    kinds = ("any", "eval_drop", "grad_blowup", "nonfinite", "entropy")
    out["collapse"] = {k: sum(r["collapse"][k] is not None for r in runs.values()) / max(len(runs), 1) for k in kinds}
    return out


def curve_band(runs: dict[int, dict[str, Any]], level: float) -> list[tuple[int, float, float, float]]:
    """(step, mean, low, high) of the held-out metric at each step every run evaluated."""
    curves = [dict(r["curve"]) for r in runs.values() if "curve" in r]
    if not curves:
        return []
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    bands = []
    for step in steps:
        band = interval([c[step] for c in curves], level)
        bands.append((step, band["mean"], band["low"], band["high"]))
    return bands
