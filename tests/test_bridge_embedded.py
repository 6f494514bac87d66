"""The embedded engine behind the protocol, and the rollout pipe's groups and staleness rules
(checked on the embedded engine, where versions are cheap to change)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from flax import nnx
from ppo_setup import TINY

from opd_jax.models import Decoder
from opd_jax.sampling import EmbeddedEngine, Sampler
from rollout_bridge.pipe import EngineThread, RolloutPipe, in_request_order
from rollout_bridge.protocol import Engine, WeightUpdate
from rollout_bridge.records import Failure, Request, SamplingParams

PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)


@pytest.fixture
def engine():
    thread = EngineThread(EmbeddedEngine(Sampler(Decoder(TINY, rngs=nnx.Rngs(0)), max_cache_len=64), seed=3))
    yield thread
    thread.close()


def test_embedded_engine_implements_the_protocol(engine):
    assert isinstance(engine.engine, Engine)


def test_a_seeded_request_draws_the_same_sample_whatever_it_is_batched_with(engine):
    alone = engine.generate([Request((5, 6, 7), PARAMS, seed=11)])[0]
    crowd = engine.generate([Request((9, 9), PARAMS, seed=1), Request((5, 6, 7), PARAMS, seed=11),
                             Request((3, 4, 5, 6), PARAMS)])
    assert crowd[1].output_ids == alone.output_ids
    np.testing.assert_allclose(crowd[1].output_logprobs, alone.output_logprobs, atol=1e-5)  # other batch shape
    unseeded = engine.generate([Request((5, 6, 7), PARAMS) for _ in range(4)])
    assert len({r.output_ids for r in unseeded}) > 1


def test_a_steps_groups_decode_as_one_batch_and_a_bad_request_fails_its_own_call(engine, monkeypatch):
    """Each group is its own stream call (the pipe's); the engine batches those that arrive together,
    so 5 groups of 2 are one generate of 10 rows, not 5 of 2, each group with its own prompt."""
    sampler = engine.engine.sampler
    calls = []
    generate = sampler.generate
    monkeypatch.setattr(sampler, "generate", lambda prompts, *a: calls.append(len(prompts)) or generate(prompts, *a))
    groups = RolloutPipe(engine, groups_source([]), max_staleness=0).take(5, trainer_version=0)
    assert calls == [10]
    assert [g[0].prompt_ids for g in groups] == [(5, 6, 7 + k % 5) for k in range(1, 6)]
    assert all(len(g) == 2 and g[0].prompt_ids == g[1].prompt_ids for g in groups)
    good = engine.submit(in_request_order(engine.engine, [Request((5, 6), PARAMS)]))
    too_long = engine.submit(in_request_order(engine.engine, [Request((5,) * 60, PARAMS)]))
    with pytest.raises(ValueError, match="cache holds 64"):
        too_long.result()
    assert len(good.result()[0].output_ids) > 0


def test_abort_before_start_and_weight_versions(engine):
    request = Request((5, 6, 7), PARAMS)
    engine.run(engine.engine.abort([request.request_id]))
    (aborted,) = engine.generate([request])
    assert aborted.finish_reason == "abort" and aborted.output_ids == ()
    engine.update_weights(WeightUpdate(4, model=lambda: Decoder(TINY, rngs=nnx.Rngs(1))))
    assert engine.weight_version == 4 and engine.generate([Request((5,), PARAMS)])[0].weight_version == 4
    with pytest.raises(Exception, match="in memory"):
        engine.update_weights(WeightUpdate(5, save_hf=lambda d: None))


def groups_source(counter):
    def next_group():
        counter.append(len(counter))
        return [Request((5, 6, 7 + len(counter) % 5), PARAMS, {"group": len(counter)}) for _ in range(2)]
    return next_group


def bump(engine, version):
    engine.update_weights(WeightUpdate(version, model=lambda: Decoder(TINY, rngs=nnx.Rngs(version))))


def test_sync_pipe_prefetches_nothing_and_serves_the_current_version(engine):
    drawn = []
    pipe = RolloutPipe(engine, groups_source(drawn), max_staleness=0)
    groups = pipe.take(3, trainer_version=0)
    assert len(groups) == 3 and all(len(g) == 2 and len({r.metadata["group"] for r in g}) == 1 for g in groups)
    assert len(drawn) == 3
    bump(engine, 1)
    assert all(r.weight_version == 1 for g in pipe.take(3, trainer_version=1) for r in g) and len(drawn) == 6


@pytest.mark.parametrize("keep_stale", [False, True])
def test_groups_older_than_max_staleness_are_dropped_or_kept(engine, keep_stale):
    drawn = []
    pipe = RolloutPipe(engine, groups_source(drawn), max_staleness=1, keep_stale=keep_stale)
    pipe.take(2, trainer_version=0)       # and 2 more prefetched at version 0
    assert len(drawn) == 4
    bump(engine, 2)
    groups = pipe.take(2, trainer_version=2)  # the prefetched ones are 2 versions old
    stats = pipe.stats.take()
    if keep_stale:
        assert stats["rollout/stale_kept"] == 2 and all(r.weight_version == 0 for g in groups for r in g)
    else:
        assert stats["rollout/stale_dropped"] == 2 and all(r.weight_version == 2 for g in groups for r in g)
        assert len(drawn) == 8  # two replacements drawn, plus two prefetched for the next step
    pipe.drain()


def test_a_group_with_a_failure_is_replaced(engine):
    drawn = []
    inner = groups_source(drawn)

    class Flaky:
        """The embedded engine, except that the first group's second request fails."""

        def __init__(self, engine):
            self.engine, self.weight_version = engine, 0

        async def stream(self, requests):
            async for c in self.engine.stream(requests):
                yield Failure(requests[1], "injected") if c.request_id == requests[1].request_id and \
                    requests[1].metadata["group"] == 1 else c

    flaky = EngineThread(Flaky(engine.engine))
    try:
        groups = RolloutPipe(flaky, inner).take(2, trainer_version=0)
    finally:
        flaky.stop_loop()
    assert [g[0].metadata["group"] for g in groups] == [2, 3] and len(drawn) == 3


@pytest.fixture
def continuous():
    thread = EngineThread(EmbeddedEngine(Sampler(Decoder(TINY, rngs=nnx.Rngs(0)), max_cache_len=64, slots=2), seed=3))
    yield thread
    thread.close()


def test_a_continuous_engine_shares_its_slots_across_stream_calls(continuous, engine):
    """Two decode slots, three stream calls started one after another: a long request of the
    first call, then short ones. The short ones take the free slot and finish while the long one
    decodes (they end first), and each request's tokens and log-probs are those of the static
    engine with the same seed."""
    long = SamplingParams(max_new_tokens=40, temperature=1.0)
    calls = [[Request((5, 6, 7), long, seed=1)], [Request((8, 9), PARAMS, seed=2)], [Request((4,), PARAMS, seed=3)]]

    async def all_calls():
        finished = []

        async def one(requests):
            async for completion in continuous.engine.stream(requests):
                finished.append(completion)
        await asyncio.gather(*(one(c) for c in calls))
        return finished

    finished = continuous.run(all_calls())
    assert [c.request_id for c in finished][-1] == calls[0][0].request_id
    assert len(finished[0].output_ids) == 6 and len(finished[-1].output_ids) == 40
    for completion in finished:
        request = next(r for c in calls for r in c if r.request_id == completion.request_id)
        (alone,) = engine.generate([request])
        assert completion.output_ids == alone.output_ids
        np.testing.assert_allclose(completion.output_logprobs, alone.output_logprobs, atol=1e-4)


def test_a_continuous_engine_refits_between_requests_and_pauses_admission(continuous):
    """A weight update waits for the request decoding (it keeps its version) while requests sent
    after it wait for the new weights; a paused engine admits nothing until resumed; an aborted
    queued request comes back aborted."""
    engine = continuous.engine

    async def scenario():
        first = asyncio.ensure_future(anext(aiter(engine.stream([Request((5, 6, 7), SamplingParams(max_new_tokens=30))]))))
        await asyncio.sleep(0)  # the first request is queued and its driver started
        refit = asyncio.ensure_future(engine.update_weights(WeightUpdate(7, model=lambda: Decoder(TINY, rngs=nnx.Rngs(1)))))
        await asyncio.sleep(0)
        later = asyncio.ensure_future(anext(aiter(engine.stream([Request((5, 6, 7), PARAMS)]))))
        old, new = await first, await later
        await refit
        await engine.pause()
        held, dropped = Request((1, 2), PARAMS), Request((3, 4), PARAMS)
        waiting = asyncio.ensure_future(anext(aiter(engine.stream([held]))))
        gone = asyncio.ensure_future(anext(aiter(engine.stream([dropped]))))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await engine.abort([dropped.request_id])
        await engine.resume()
        return old, new, await waiting, await gone

    old, new, resumed, aborted = continuous.run(scenario())
    assert old.weight_version == 0 and new.weight_version == 7 and resumed.weight_version == 7
    assert len(resumed.output_ids) == 6 and aborted.finish_reason == "abort" and aborted.output_ids == ()
