"""How a model's training forward computes, apart from what it computes: the knobs that trade
memory for compute on long sequences (docs/long_sequences.md). None changes a result beyond float
rounding."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax

from opd_jax.models.attention import Implementation

Remat = Literal["auto", "none", "full", "dots", "offload"]
"""What the backward keeps of each layer's forward: everything (none), nothing but the layer's
input (full: the layer is run again), the weight matmuls' outputs (dots), or those moved to host
memory (offload; accelerators with pinned host memory); auto: full for sequences longer than
REMAT_FROM tokens, none up to it."""

REMAT_FROM = 2048
"""Longest sequence `remat: auto` keeps every activation of: below it the layers' activations are
at most the size of the weights and optimizer state, and recomputing them cost 6 to 17% more
step time (measured); above it they dominate (BENCHMARKS.md, "Long sequences")."""


@dataclasses.dataclass(frozen=True)
class Execution:
    """attention: dense, blockwise (O(T) memory) or auto (blockwise past one block);
    attention_block: queries and keys per block; remat: the layer scan's rematerialisation;
    logits_chunk: tokens whose logits exist at once when log-probs, entropies or OPD's
    divergences are taken (the LM head runs chunk by chunk, forward and backward;
    `core.distributions.chunked_positions`)."""

    attention: Implementation = "auto"
    attention_block: int = 512
    remat: Remat = "auto"
    logits_chunk: int = 2048

    def checkpoint_policy(self, length: int):
        """The jax.checkpoint policy of `remat` for sequences of `length` tokens (None: no
        rematerialisation)."""
        policies = jax.checkpoint_policies
        remat = self.remat if self.remat != "auto" else ("full" if length > REMAT_FROM else "none")
        if remat == "offload":  # built only when asked: it names memory kinds a CPU lacks
            return policies.offload_dot_with_no_batch_dims("device", "pinned_host")
        return {"none": None, "full": policies.nothing_saveable,
                "dots": policies.dots_with_no_batch_dims_saveable}[remat]
