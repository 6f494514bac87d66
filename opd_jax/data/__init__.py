"""Prompt data: built-in verifiable domains, JSONL sources, and the grain pipeline of a run."""

from opd_jax.data.domains import DOMAINS, Domain, Example, get_domain
from opd_jax.data.pipeline import eval_prompts, source_domains, take, train_prompts, training_stream, validation_prompts
from opd_jax.data.sources import DataError, ProceduralSource, read_jsonl

__all__ = ["DOMAINS", "DataError", "Domain", "Example", "ProceduralSource", "eval_prompts", "get_domain",
           "read_jsonl", "source_domains", "take", "train_prompts",
           "training_stream", "validation_prompts"]
