"""The synchronous trainer's handle on an async engine: the engine's event loop runs in a
background thread, so generation goes on while the trainer computes.

`EngineThread.generate(requests)` is the plain blocking call (results in request order).
`RolloutPipe` adds what an RL loop needs on top: whole groups (the G samples of one prompt),
prefetching so generation for step n+1 overlaps training on step n, and bounded staleness: a
group whose oldest rollout is more than `max_staleness` weight versions behind the trainer is
dropped and counted (or kept, with keep_stale). With max_staleness = 0 nothing is prefetched
and the loop is synchronous. Groups with a Failure are dropped and counted; either way a fresh
group is drawn from the source in its place.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import inspect
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from opd_jax.errors import OpdJaxError
from rollout_bridge.protocol import Engine, WeightUpdate
from rollout_bridge.records import Completion, Failure, Request, Rollout

T = TypeVar("T")


async def in_request_order(engine: Engine, requests: Sequence[Request]) -> list[Completion]:
    """All of one `stream` call's completions, in the requests' order."""
    done = {c.request_id: c async for c in engine.stream(requests)}
    return [done[r.request_id] for r in requests]


class PipeError(OpdJaxError, RuntimeError):
    """The pipe could not collect the groups asked for (every replacement failed too)."""


class LoopThread:
    """An asyncio event loop running in a daemon thread, driven from synchronous code."""

    def __init__(self, name: str = "rollout-engine"):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Awaitable[T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def submit(self, coroutine: Awaitable[T]):
        """Start a coroutine on the loop; returns a concurrent.futures.Future."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def submit_together(self, coroutines: Sequence[Awaitable[T]]) -> list[concurrent.futures.Future]:
        """Start the coroutines in one turn of the loop, in order (so an engine that batches what
        arrives together sees all their first requests at once, whatever the threads' timing);
        a concurrent.futures.Future of each one's result."""
        futures = [concurrent.futures.Future() for _ in coroutines]

        def start() -> None:
            for coroutine, future in zip(coroutines, futures):
                task = asyncio.ensure_future(coroutine, loop=self._loop)
                task.add_done_callback(functools.partial(_settle, future))

        self._loop.call_soon_threadsafe(start)
        return futures

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the loop, before anything submitted after this call."""
        self._loop.call_soon_threadsafe(fn, *args)

    def stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def _settle(future: concurrent.futures.Future, task: asyncio.Future) -> None:
    """Pass a finished task's outcome to the thread waiting on `future`."""
    if task.cancelled():
        future.cancel()
    elif task.exception() is not None:
        future.set_exception(task.exception())
    else:
        future.set_result(task.result())


class EngineThread(LoopThread):
    """An engine driven from synchronous code through its own event loop thread."""

    def __init__(self, engine: Engine):
        super().__init__()
        self.engine = engine

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """One Completion per request, in the requests' order."""
        return self.run(in_request_order(self.engine, requests))

    def update_weights(self, update: WeightUpdate) -> None:
        self.run(self.engine.update_weights(update))

    def start(self):
        """engine.start() on the loop; a Future, so several engines start side by side."""
        return self.submit(self.engine.start())

    def score(self, sequences: Sequence[Sequence[int]]):
        """engine.score(sequences) on the loop; a Future of the per-token log-probs."""
        return self.submit(self.engine.score(sequences))

    def metrics(self) -> dict[str, float]:
        return self.engine.metrics()

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @property
    def logprob_convention(self) -> str:
        return self.engine.logprob_convention

    def close(self) -> None:
        try:
            self.run(self.engine.close(), timeout=180)  # launched servers get time to stop
        finally:
            self.stop_loop()


@dataclasses.dataclass
class PipeStats:
    stale_dropped: int = 0
    stale_kept: int = 0
    failed_groups: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)  # the latest few, for the log

    def take(self) -> dict[str, float]:
        out = {"rollout/stale_dropped": float(self.stale_dropped), "rollout/stale_kept": float(self.stale_kept),
               "rollout/failed_groups": float(self.failed_groups)}
        self.stale_dropped = self.stale_kept = self.failed_groups = 0
        return out


class RolloutPipe:
    """Groups of rollouts for the trainer. `source()` returns the requests of one new group (all
    sharing one prompt), or an awaitable that produces the group itself (multi-turn episodes, each
    with a `weight_version`; run on the engine's loop); `take(n, version)` returns n complete
    groups fit to train weights `version` on, submitting replacements for any it drops."""

    def __init__(self, engine: EngineThread, source: Callable[[], list[Request] | Awaitable[list[Any]]], *,
                 max_staleness: int = 0, keep_stale: bool = False, max_dropped: int = 64):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.engine, self.source = engine, source
        self.max_staleness, self.keep_stale, self.max_dropped = max_staleness, keep_stale, max_dropped
        self.stats = PipeStats()
        self._pending: list[Any] = []  # futures of whole groups, oldest first

    def _submit_groups(self, n: int) -> None:
        # every group drawn before any is submitted: a source that books its work with the engine's
        # loop (episodes, see opd_jax.envs) has booked all of it before the first one starts
        groups = [self.source() for _ in range(n)]
        self._pending.extend(self.engine.submit_together(
            [group if inspect.isawaitable(group) else in_request_order(self.engine.engine, group) for group in groups]))

    def take(self, n: int, trainer_version: int) -> list[list[Rollout]]:
        """n complete groups; then (if max_staleness > 0) n more are submitted to generate while
        the trainer works on these."""
        self._submit_groups(n - len(self._pending))
        groups: list[list[Rollout]] = []
        dropped = 0
        while len(groups) < n:
            group = self._pending.pop(0).result()
            failures = [c for c in group if isinstance(c, Failure)]
            if failures:
                self.stats.failed_groups += 1
                self.stats.failures = (self.stats.failures + [f.error for f in failures])[-5:]
            elif trainer_version - min(r.weight_version for r in group) > self.max_staleness:
                if self.keep_stale:
                    self.stats.stale_kept += 1
                    groups.append(group)
                    continue
                self.stats.stale_dropped += 1
            else:
                groups.append(group)
                continue
            dropped += 1
            if dropped > self.max_dropped:
                raise PipeError(f"dropped {dropped} groups while collecting {n} (stale: {self.stats.stale_dropped}, "
                                f"failed: {self.stats.failed_groups}); last failures: {self.stats.failures}")
            self._submit_groups(1)
        if self.max_staleness > 0:
            self._submit_groups(n - len(self._pending))
        return groups

    def drain(self) -> None:
        """Wait for prefetched groups (so nothing is in flight at a checkpoint or the end)."""
        for future in self._pending:
            future.result()
        self._pending.clear()
