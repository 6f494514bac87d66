"""The embedded JAX sampler behind rollout_bridge's engine protocol, so the training loop drives
it exactly as it drives SGLang servers.

Each `stream()` call is one batched `Sampler.generate`, run in a worker thread so the event loop
(and the trainer) are not blocked. A request with a `seed` draws from key(seed), so its sample
does not depend on what it is batched with; otherwise from fold_in(key(engine seed), counter).
An abort or pause takes effect between batches: a batch in flight finishes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opd_jax.core import token_logprobs
from opd_jax.sampling.engine import Sampler
from rollout_bridge.protocol import TEMPERED_UNTRUNCATED, EngineError, WeightUpdate
from rollout_bridge.records import Completion, Request, Rollout


@functools.partial(jax.jit, static_argnums=0)
def _logprobs(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    logits = nnx.merge(graphdef, state)(tokens, attention_mask=mask)
    return token_logprobs(logits, tokens)[0]


def _score(graphdef: nnx.GraphDef, state: nnx.State, sequences: Sequence[Sequence[int]], pad_id: int
           ) -> list[list[float]]:
    length = max(len(s) for s in sequences)
    length = 16 * -(-length // 16)  # a few compiled shapes
    tokens = np.full((len(sequences), length), pad_id, np.int32)
    mask = np.zeros((len(sequences), length), np.int32)
    for i, s in enumerate(sequences):
        tokens[i, :len(s)], mask[i, :len(s)] = s, 1
    logp = np.asarray(_logprobs(graphdef, state, jnp.asarray(tokens), jnp.asarray(mask)))
    return [logp[i, 1:len(s)].tolist() for i, s in enumerate(sequences)]


class EmbeddedEngine:
    logprob_convention = TEMPERED_UNTRUNCATED  # `sample_tokens`

    def __init__(self, sampler: Sampler, seed: int = 0):
        self.sampler = sampler
        self._base_key = jax.random.key(seed)
        self._counter = 0
        self._aborted: set[str] = set()
        self._running: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None

    @property
    def weight_version(self) -> int:
        return self.sampler.weight_version

    def _ensure(self) -> None:
        if self._running is None:
            self._running, self._lock = asyncio.Event(), asyncio.Lock()
            self._running.set()

    def _keys(self, requests: Sequence[Request]) -> jax.Array:
        keys = []
        for r in requests:
            if r.seed is None:
                self._counter += 1
                keys.append(jax.random.fold_in(self._base_key, self._counter))
            else:
                keys.append(jax.random.key(r.seed))
        return jnp.stack(keys)

    async def stream(self, requests: Sequence[Request]) -> AsyncIterator[Completion]:
        if not requests:
            return
        self._ensure()
        began = time.perf_counter()
        await self._running.wait()
        live = [r for r in requests if r.request_id not in self._aborted]
        for r in requests:
            if r.request_id in self._aborted:
                self._aborted.discard(r.request_id)
                yield Rollout(r.prompt_ids, (), (), "abort", self.weight_version, dict(r.metadata), r.request_id)
        if not live:
            return
        async with self._lock:  # one batch at a time; weights cannot change under it
            rollouts = await asyncio.to_thread(self.sampler.generate, [r.prompt_ids for r in live],
                                               [r.params for r in live], self._keys(live),
                                               [r.metadata for r in live])
        latency = time.perf_counter() - began
        for request, rollout in zip(live, rollouts):
            yield dataclasses.replace(rollout, request_id=request.request_id, latency_s=latency)

    async def update_weights(self, update: WeightUpdate) -> None:
        if update.model is None:
            raise EngineError("the embedded engine takes the model in memory; this update has none")
        self._ensure()
        async with self._lock:
            self.sampler.update_weights(update.model(), update.version)

    async def start(self) -> None:
        pass

    async def health(self) -> bool:
        return True

    def metrics(self) -> dict[str, float]:
        return {}

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """log p(token_i | tokens before it) for every token after the first of each sequence,
        under the served weights (untempered), as SGLang's prompt log-probs."""
        self._ensure()
        async with self._lock:
            graphdef, state = self.sampler.graphdef, self.sampler.state
        return await asyncio.to_thread(_score, graphdef, state, sequences, self.sampler.pad_id)

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        self._aborted.update(request_ids or ())

    async def pause(self) -> None:
        self._ensure()
        self._running.clear()

    async def resume(self) -> None:
        self._ensure()
        self._running.set()

    async def close(self) -> None:
        pass
