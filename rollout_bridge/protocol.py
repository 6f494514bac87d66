"""The one interface every rollout engine implements: the embedded JAX sampler and SGLang servers
alike, so the training loop cannot tell them apart.

An engine is asynchronous. `stream(requests)` yields one `Completion` per request, in completion
order: a `Rollout`, or a `Failure` that says why there is none. Nothing is yielded twice and
nothing is dropped, whatever happens to the servers behind it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from opd_jax.errors import OpdJaxError
from rollout_bridge.records import Completion, Request


@dataclasses.dataclass(frozen=True)
class WeightUpdate:
    """New policy weights, offered in both forms an engine may want; each is built only if asked
    for. `model()` gives the engine-precision model in memory (embedded engine);
    `save_hf(directory)` writes it as a Hugging Face directory (SGLang's update_weights_from_disk
    or a server restart). A LoRA policy also offers `adapters()`: its adapters alone, in the
    engine's precision (the pure dict of the model's LoRA parameters), for an engine that holds
    the base from an earlier update's `model()` and so moves nothing else."""

    version: int
    model: Callable[[], Any] | None = None
    save_hf: Callable[[Path], None] | None = None
    adapters: Callable[[], Any] | None = None


class EngineError(OpdJaxError, RuntimeError):
    """An engine that cannot do what was asked (refit rejected, no server healthy, ...)."""


# What a rollout's log-probs are of: the tempered distribution log_softmax(logits / T), before
# top-k / top-p truncation (SGLang's default), the one the trainer scores; or of the untempered
# logits (SGLang with SGLANG_RETURN_ORIGINAL_LOGPROB set), which a trainer at T != 1 cannot
# compare with.
TEMPERED_UNTRUNCATED = "tempered, untruncated"
UNTEMPERED_UNTRUNCATED = "untempered, untruncated"


@runtime_checkable
class Engine(Protocol):
    """What the loop needs from a rollout engine."""

    logprob_convention: str  # TEMPERED_UNTRUNCATED or UNTEMPERED_UNTRUNCATED

    @property
    def weight_version(self) -> int:
        """The version every new rollout is generated with."""
        ...

    def stream(self, requests: Sequence[Request]) -> AsyncIterator[Completion]:
        """Submit the requests; yield exactly one Completion per request as each finishes."""
        ...

    async def update_weights(self, update: WeightUpdate) -> None:
        """Serve `update` from now on; returns once every replica reports the new version."""
        ...

    async def start(self) -> None:
        """Make the engine ready: launch the servers it owns, if any, and wait until one answers;
        EngineError (with the server's log) when none does."""
        ...

    async def health(self) -> bool:
        """True when the engine can take requests now."""
        ...

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher scoring: log p(token_i | tokens before it) under the served weights, for every
        token after the first of each sequence (untempered)."""
        ...

    def metrics(self) -> dict[str, float]:
        """The engine's counters since it started (retries, failed requests, refit seconds, server
        crashes, ...), by name; an engine without any returns {}."""
        ...

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        """End the given in-flight requests (all of them for None); each still yields one
        Completion, a rollout with finish_reason 'abort' and whatever it had generated."""
        ...

    async def pause(self) -> None:
        """Stop generating: in-flight requests end as aborts; new ones wait for resume()."""
        ...

    async def resume(self) -> None:
        ...

    async def close(self) -> None:
        """Release everything, the servers the engine's start() launched included."""
        ...
