"""`opd-jax mismatch`: how far a rollout engine is from the trainer, on which tokens, and how it
grows with response length (census: sampling and scoring; figures: the formulas; report: the
tables and plots)."""

from opd_jax.mismatch.census import census_model, run_census
from opd_jax.mismatch.figures import Tokens, census_figures
from opd_jax.mismatch.report import aggregate, write_report

__all__ = ["Tokens", "aggregate", "census_figures", "census_model", "run_census", "write_report"]
