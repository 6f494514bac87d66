"""The typed config of `opd-jax sweep`: a base training config, the cells (a grid of dotted
overrides and/or a list of named cells), the seeds every cell runs, and what to aggregate."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from opd_jax.config.schema import Section


class CellSpec(Section):
    """One named cell: dotted overrides on top of the sweep's own."""

    name: str
    """The cell's name (its run directories, tables and comparisons use it)."""
    overrides: dict[str, Any] = {}
    """Dotted key: value pairs, e.g. {algorithm.ppo.surrogate.mismatch.kind: tis}."""


class CollapseSection(Section):
    """When a run counts as collapsed (any of these, first step reported)."""

    eval_drop: float = Field(0.1, ge=0)
    """The held-out metric falls below its first evaluation by more than this."""
    grad_norm_factor: float = Field(10.0, gt=1)
    """policy/grad_norm exceeds this many times its median over the grad_norm_window steps before it
    (a spike; the norm of a run that learns grows slowly, tens of times over hundreds of steps)."""
    grad_norm_window: int = Field(20, ge=5)
    """How many preceding steps' policy/grad_norm the spike is measured against (their median)."""
    entropy_floor: float = Field(0.05, ge=0)
    """policy/entropy (nats per token) falls below this."""


class PrimarySection(Section):
    """The primary outcome and its test, declared before the sweep runs: sweep.json records it
    and sweep.md reports it first; every other comparison is exploratory."""

    outcome: Literal["final", "best", "gain", "last_mean", "collapsed"]
    """Per run: the final held-out metric, its best, final − first, the mean of its last `last`
    evaluations, or whether the run collapsed (the `collapse` rule)."""
    last: int = Field(1, ge=1)
    """last_mean: how many of the last evaluations are averaged."""
    contrasts: list[tuple[str, str]] = Field(min_length=1)
    """Pairs of cells [a, b]: each tested as a − b (collapsed: a's collapse rate against b's)."""
    test: Literal["paired_t", "non_inferiority", "fisher_exact"] = "paired_t"
    """paired_t: paired t-test of a − b over seeds; non_inferiority: one-sided paired t-test that
    a − b > −margin (a no worse than b by more than the margin); fisher_exact: Fisher's exact test
    on the collapse counts (outcome collapsed)."""
    alternative: Literal["two-sided", "greater", "less"] = "two-sided"
    """The alternative hypothesis of paired_t and fisher_exact: a − b ≠ 0, > 0 or < 0 (collapsed:
    a's rate ≠, >, < b's); non_inferiority is one-sided (greater) by definition."""
    margin: float = Field(0.0, ge=0)
    """non_inferiority's margin, in the outcome's units."""
    correction: Literal["none", "bonferroni", "holm"] = "bonferroni"
    """How the contrasts' p-values are corrected for being several."""
    alpha: float = Field(0.05, gt=0, lt=1)
    """The level each corrected p-value is compared with."""

    @model_validator(mode="after")
    def _check(self) -> PrimarySection:
        if (self.outcome == "collapsed") != (self.test == "fisher_exact"):
            raise ValueError("primary: the outcome 'collapsed' is tested with fisher_exact, and fisher_exact "
                             "tests only 'collapsed'")
        if self.test == "non_inferiority" and self.margin <= 0:
            raise ValueError("primary.margin: a non-inferiority test needs a margin > 0")
        if self.test == "non_inferiority" and self.alternative != "two-sided":
            raise ValueError("primary.alternative: non_inferiority is one-sided by definition; leave it unset")
        return self


class SweepConfig(Section):
    """`opd-jax sweep`: every cell × every seed as an independent `opd-jax train` (or `opd-jax
    merge`) run."""

    command: Literal["train", "merge"] = "train"
    """What every run is: `opd-jax train` (base is a training config) or `opd-jax merge` (a merge config)."""
    base: Path
    """The config every run starts from (relative to the sweep file)."""
    overrides: dict[str, Any] = {}
    """Dotted overrides for every cell."""
    grid: dict[str, list[Any]] = {}
    """Dotted key: values; the cells are their Cartesian product (named key=value,...)."""
    axes: dict[str, dict[str, dict[str, Any]]] = {}
    """Named axes, each {label: dotted overrides}: a setting that takes several keys (an engine, a
    model) as one grid value. The cells are the product of the grid's values and every axis's
    labels (named key=value,...,axis=label,...)."""
    cells: list[CellSpec] = []
    """Named cells, besides (or instead of) the grid's."""
    seeds: int | list[int] = 3
    """How many seeds (0..n−1) or which; each cell runs every one. At least 2 (an interval needs them)."""
    seed_keys: list[str] | None = None
    """The config keys set to the run's seed (what a seed moves); unset: seed, model.fresh.seed and
    data.seed for train (sampling, model init, prompt order), seed and data.seed for merge."""
    eval_metric: str = "eval/accuracy"
    """The held-out metric: final, best and gain over its first evaluation, per cell."""
    metrics: list[str] = []
    """Training metrics aggregated per cell (each run's mean over the steps that logged them)."""
    primary: PrimarySection | None = None
    """The primary outcome, contrasts and test, declared before anything runs (docs/sweeps.md); without it every comparison is exploratory."""  # noqa: E501
    compare: list[tuple[str, str]] = []
    """Pairs of cells [a, b]: the paired difference a − b of the final held-out metric over the seeds both ran (exploratory)."""
    confidence: float = Field(0.95, gt=0, lt=1)
    """Level of every interval (Student's t over seeds)."""
    collapse: CollapseSection = CollapseSection()
    """When a run counts as collapsed."""
    warm_start: Literal["per_run", "shared"] = "per_run"
    """per_run: every run does the base config's supervised warm start itself. shared: each distinct
    warm start (same model, data, sft settings and seed) runs once (`opd-jax sft`, in
    <out>/_warm_start/) and the runs that need it start from its model: paid once per seed, and
    cells that differ only in RL settings start from the same policy. A shared warm start trains
    every weight (it makes the base): a cell with model.lora puts its adapters on it for RL."""
    out: Path | None = None
    """Where the runs and the results go (default: runs/sweeps/<sweep file's name>)."""

    @model_validator(mode="after")
    def _check(self) -> SweepConfig:
        if self.command == "merge" and self.warm_start == "shared":
            raise ValueError("warm_start 'shared' is for command 'train' (a merge starts from its experts' base)")
        if not self.grid and not self.axes and not self.cells:
            raise ValueError("the sweep has no cells: give a grid, axes, cells, or a mix")
        empty = [k for k, v in self.grid.items() if not v]
        if empty:
            raise ValueError(f"grid key {empty[0]} has no values")
        empty = [k for k, v in self.axes.items() if not v]
        if empty:
            raise ValueError(f"axis {empty[0]} has no labels")
        if len(self.seed_list) < 2:
            raise ValueError(f"seeds: {len(self.seed_list)} seed(s); a confidence interval needs at least 2")
        names = [name for name, _ in self.cell_overrides()]
        if len(set(names)) != len(names):
            raise ValueError(f"two cells are named {next(n for n in names if names.count(n) > 1)!r}")
        return self

    def checked(self) -> SweepConfig:
        """The config with the pairs of `compare` and `primary.contrasts` as cell names (a name as
        the grid writes it, `kind=[1, 2]`, is the cell's name with its characters made safe);
        ValueError naming the key for a cell that does not exist. Asked once the cells resolve, so
        a bad grid value is named as such, not as a missing cell."""
        names = [name for name, _ in self.cell_overrides()]

        def resolved(key: str, pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
            out = [(cell_name(a), cell_name(b)) for a, b in pairs]
            for name in (n for pair in out for n in pair):
                if name not in names:
                    raise ValueError(f"{key}: no cell named {name!r} (cells: {', '.join(names)})")
            return out

        update: dict[str, Any] = {"compare": resolved("compare", self.compare)}
        if self.primary is not None:
            update["primary"] = self.primary.model_copy(
                update={"contrasts": resolved("primary.contrasts", self.primary.contrasts)})
        return self.model_copy(update=update)

    @property
    def seed_key_list(self) -> list[str]:
        if self.seed_keys is not None:
            return self.seed_keys
        return ["seed", "model.fresh.seed", "data.seed"] if self.command == "train" else ["seed", "data.seed"]

    @property
    def seed_list(self) -> list[int]:
        return list(range(self.seeds)) if isinstance(self.seeds, int) else list(self.seeds)

    def cell_overrides(self) -> list[tuple[str, dict[str, Any]]]:
        """(name, overrides) of every cell: the product of the grid and the axes, in order, then the
        named ones."""
        cells = []
        if self.grid or self.axes:
            keys = list(self.grid)
            for values in itertools.product(*(self.grid[k] for k in keys), *(self.axes[a].items() for a in self.axes)):
                plain, labelled = values[:len(keys)], values[len(keys):]
                name = ",".join([*(f"{k.rsplit('.', 1)[-1]}={_short(v)}" for k, v in zip(keys, plain)),
                                 *(f"{axis}={label}" for axis, (label, _) in zip(self.axes, labelled))])
                overrides = dict(zip(keys, plain))
                for _, extra in labelled:
                    overrides.update(extra)
                cells.append((cell_name(name), overrides))
        return cells + [(c.name, dict(c.overrides)) for c in self.cells]


def cell_name(name: str) -> str:
    """A cell's name as its run directories can hold it."""
    return re.sub(r"[^\w.,=+-]", "_", name.replace(" ", ""))


def _short(value: Any) -> str:
    return str(value).replace(" ", "")
