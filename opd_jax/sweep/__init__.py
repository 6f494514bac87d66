"""Seeded experiment sweeps: cells × seeds as independent training runs, aggregated with
confidence intervals (`run_sweep`, `aggregate`; the `opd-jax sweep` command); `reduced` makes a
small copy of a sweep file (fewer seeds and cells, shorter runs); `paired` compares two cells' runs
by seed (also across sweeps that share seeds and warm starts)."""

from opd_jax.sweep.run import Sweep, SweepError, aggregate, aggregate_only, reduced, run_sweep
from opd_jax.sweep.stats import paired

__all__ = ["Sweep", "SweepError", "aggregate", "aggregate_only", "paired", "reduced", "run_sweep"]
