"""The embedded rollout engine: jitted batched sampling with per-token logprobs."""

from opd_jax.sampling.embedded_engine import EmbeddedEngine
from opd_jax.sampling.engine import PromptTooLongError, Sampler
from opd_jax.sampling.ops import sample_tokens, truncate_top_k_top_p
from rollout_bridge.records import Rollout, SamplingParams

__all__ = ["EmbeddedEngine", "PromptTooLongError", "Rollout", "Sampler", "SamplingParams", "sample_tokens",
           "truncate_top_k_top_p"]
