"""Seeded experiment sweeps: cells × seeds as independent training runs, aggregated with
confidence intervals (`run_sweep`, `aggregate`; the `opd-jax sweep` command)."""

from opd_jax.sweep.run import Sweep, SweepError, aggregate, run_sweep

__all__ = ["Sweep", "SweepError", "aggregate", "run_sweep"]
