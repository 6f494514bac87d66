"""rollout_bridge: what every rollout engine speaks, whether the embedded JAX sampler or SGLang.

It defines the request parameters and the rollout record the training loop consumes; it never
imports the training loop.
"""

from rollout_bridge.records import FinishReason, Rollout, SamplingParams

__all__ = ["FinishReason", "Rollout", "SamplingParams"]
