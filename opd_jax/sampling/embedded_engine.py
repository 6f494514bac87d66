"""The embedded JAX sampler behind rollout_bridge's engine protocol, so the training loop drives
it exactly as it drives SGLang servers.

Without decode slots, the requests of every `stream()` call waiting when a batch starts are one
batched `Sampler.generate` (a step's groups, each its own call, decode together), run in a worker
thread so the event loop (and the trainer) are not blocked. With them (`Sampler(slots=)`,
rollout.decode_slots) the engine batches continuously across calls: every stream call's requests
join one queue, and a driver task feeds them into the slots at each decode chunk
(`DecodeSlots`), so the next turn of a multi-turn episode starts as soon as its environment has
answered instead of waiting for the other episodes' turns. Each request is prefilled alone, so
its numbers do not depend on when it arrived.

A request with a `seed` draws from key(seed), so its sample does not depend on what it is batched
with; otherwise from fold_in(key(engine seed), counter). An abort or pause takes effect between
batches (continuously: before a request is admitted); what is decoding finishes. A weight update
waits until nothing decodes, and requests that arrive meanwhile wait for the new weights.
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


def _failed(error: Exception) -> EngineError:
    """What every request of a batch (static or continuous) that failed is answered with."""
    return EngineError(f"the embedded engine failed: {type(error).__name__}: {error}")


class EmbeddedEngine:
    logprob_convention = TEMPERED_UNTRUNCATED  # `sample_tokens`

    def __init__(self, sampler: Sampler, seed: int = 0):
        self.sampler = sampler
        self._base_key = jax.random.key(seed)
        self._counter = 0
        self._aborted: set[str] = set()
        self._running: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        self._queue: list[tuple[Request, jax.Array, asyncio.Future]] = []  # continuous: waiting for a slot
        self._waiting: list[tuple[Request, jax.Array, asyncio.Future]] = []  # static: for the next batch
        self._driver: asyncio.Task | None = None
        self._refits_waiting = 0
        self._session_past: dict[str, tuple[int, ...]] = {}  # session -> the sequence its last request left stored

    @property
    def batches_continuously(self) -> bool:
        """Requests of different stream calls share the decode batch (send each when it is ready)."""
        return self.sampler.slots is not None

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
        if self.batches_continuously:
            async for completion in self._stream_continuous(live, began):
                yield completion
            return
        for request in live:  # a bad request fails its own call, not the batch it would join
            self.sampler.check(request.prompt_ids, request.params, f"request {request.request_id}")
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in live]
        self._waiting.extend(zip(live, self._keys(live), futures))
        await asyncio.sleep(0)  # the stream calls submitted with this one join the same batch
        async with self._lock:  # one batch at a time; weights cannot change under it
            if not futures[0].done():  # else an earlier holder's batch took these requests
                await self._generate_waiting()
        latency = time.perf_counter() - began
        for request, future in zip(live, futures):
            rollout = await future
            self._remember(request, rollout)
            yield dataclasses.replace(rollout, request_id=request.request_id, latency_s=latency)

    async def _generate_waiting(self) -> None:
        """One `Sampler.generate` for every request waiting (of all stream calls): a step's groups
        are one decode batch, not one batch per group. Each request keeps its own key, so its
        sample does not depend on the others; an error reaches every call in the batch."""
        batch, self._waiting = self._waiting, []
        try:
            rollouts = await asyncio.to_thread(self.sampler.generate, [r.prompt_ids for r, _, _ in batch],
                                               [r.params for r, _, _ in batch], jnp.stack([k for _, k, _ in batch]),
                                               [r.metadata for r, _, _ in batch])
        except Exception as e:
            for _, _, future in batch:
                future.set_exception(_failed(e))
            return
        for (_, _, future), rollout in zip(batch, rollouts):
            future.set_result(rollout)

    async def _stream_continuous(self, live: Sequence[Request], began: float) -> AsyncIterator[Completion]:
        loop = asyncio.get_running_loop()
        for request in live:  # all checked before any is queued
            self.sampler.check(request.prompt_ids, request.params, f"request {request.request_id}")
        futures = []
        for request, key in zip(live, self._keys(live)):
            futures.append(loop.create_future())
            self._queue.append((request, key, futures[-1]))
        self._drive()
        for next_done in asyncio.as_completed(futures):
            request, rollout = await next_done
            self._remember(request, rollout)
            yield dataclasses.replace(rollout, request_id=request.request_id, latency_s=time.perf_counter() - began)

    def _remember(self, request: Request, rollout: Rollout) -> None:
        if request.session is not None and self.sampler.prefix_store is not None and rollout.finish_reason != "abort":
            self._session_past[request.session] = rollout.prompt_ids + rollout.output_ids

    def release(self, sessions: Sequence[str]) -> None:
        """These sessions (episodes) ended: their stored past is released (dropped unless
        another session stored the same sequence)."""
        for session in sessions:
            past = self._session_past.pop(session, None)
            if past is not None and self.sampler.prefix_store is not None:
                self.sampler.prefix_store.release(past)

    def _drive(self) -> None:
        """Start the driver unless it runs (or a pause or weight update holds the queue)."""
        if self._queue and (self._driver is None or self._driver.done()) and self._running.is_set() \
                and not self._refits_waiting:
            self._driver = asyncio.get_running_loop().create_task(self._decode_queue())

    async def _decode_queue(self) -> None:
        """Decode chunks until nothing is queued or decoding: admit what is queued (aborted ones
        answered with an abort), one chunk in a worker thread, answer what finished. Holds the
        lock, so the weights stay those the requests started with."""
        async with self._lock:
            slots = self.sampler.decode_slots()
            in_flight: dict[str, tuple[Request, asyncio.Future]] = {}
            try:
                while True:
                    if self._running.is_set() and not self._refits_waiting:  # else: finish what decodes
                        for request, key, future in self._queue:
                            if request.request_id in self._aborted:
                                self._aborted.discard(request.request_id)
                                future.set_result((request, Rollout(request.prompt_ids, (), (), "abort",
                                                                    self.weight_version, dict(request.metadata))))
                                continue
                            slots.submit(request.request_id, request.prompt_ids, request.params, key)
                            in_flight[request.request_id] = request, future
                        self._queue.clear()
                    if not slots.busy:
                        return
                    for request_id, result in await asyncio.to_thread(slots.step):
                        request, future = in_flight.pop(request_id)
                        if not future.done():
                            future.set_result((request, self.sampler.rollout(request.prompt_ids, result,
                                                                             request.metadata)))
            except Exception as e:  # every request decoding or waiting gets the error, in its stream call
                for _, future in [*in_flight.values(), *((f, f) for _, _, f in self._queue)]:
                    if not future.done():
                        future.set_exception(_failed(e))
                self._queue.clear()

    async def update_weights(self, update: WeightUpdate) -> None:
        if update.model is None and update.adapters is None:
            raise EngineError("the embedded engine takes the model in memory; this update has none")
        self._ensure()
        self._refits_waiting += 1  # the driver admits nothing more; requests queue for the new weights
        try:
            async with self._lock:
                if self._waiting:  # asked for before this update: served by the weights they were asked of
                    await self._generate_waiting()
                if update.adapters is not None and (self.sampler.config.lora is not None or update.model is None):
                    self.sampler.update_adapters(update.adapters(), update.version)  # the base stays
                else:
                    self.sampler.update_weights(update.model(), update.version)
        finally:
            self._refits_waiting -= 1
            self._drive()

    async def start(self) -> None:
        pass

    async def health(self) -> bool:
        return True

    def metrics(self) -> dict[str, float]:
        """Since the last call: the share of prompt tokens the batches did not prefill (equal
        prompts shared, stored prefixes extended) and the prefix store's hits and evictions."""
        store = self.sampler.prefix_store
        return {**self.sampler.prefill_stats.take(), **(store.stats.take() if store is not None else {})}

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
        self._drive()

    async def close(self) -> None:
        pass
