"""rollout_bridge against a real sglang-jax server on loopback (launched and supervised by the
bridge's own ServerGroup): generation streamed and not, logprobs against the trainer's
recomputation, stop tokens, teacher scoring, abort, pause/continue, and faults injected by a
proxy in front of the server. Refit and crashes are in test_bridge_sglang_refit.py."""

from __future__ import annotations

import time

import numpy as np
import pytest
from fault_proxy import FaultProxy
from sglang_setup import collect, running_servers, save_tiny, tiny_model, trainer_logprobs, wait_for_tokens

from rollout_bridge.pipe import EngineThread
from rollout_bridge.protocol import EngineError
from rollout_bridge.records import Failure, Request, Rollout, SamplingParams
from rollout_bridge.servers import free_port
from rollout_bridge.sglang_engine import SGLangEngine

PROMPTS = [tuple(range(3 + i % 5, 9 + i % 7)) for i in range(16)]
MODEL = tiny_model(0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang")
    with running_servers(save_tiny(root / "model", 0), root / "logs") as (group, _):
        yield group.urls[0]


@pytest.fixture
def engine(server, request):
    thread = EngineThread(SGLangEngine([server], **getattr(request, "param", {})))
    yield thread
    thread.close()


def assert_matches_trainer(rollout: Rollout, temperature: float, model=MODEL, atol: float = 1e-4) -> None:
    ours = trainer_logprobs(model, rollout.prompt_ids, rollout.output_ids, temperature)
    np.testing.assert_allclose(rollout.output_logprobs, ours, atol=atol)


@pytest.mark.parametrize("engine", [{"stream": True}, {"stream": False}], indirect=True, ids=["stream", "plain"])
def test_generation_logprobs_equal_the_trainers_recomputation(engine):
    params = SamplingParams(max_new_tokens=12, temperature=0.7)
    requests = [Request(p, params, {"domain": "d", "group": i}) for i, p in enumerate(PROMPTS)]
    rollouts = engine.generate(requests)
    assert [r.request_id for r in rollouts] == [q.request_id for q in requests]
    for request, rollout in zip(requests, rollouts):
        assert isinstance(rollout, Rollout) and rollout.prompt_ids == request.prompt_ids
        assert rollout.metadata == request.metadata and rollout.weight_version == 0
        assert len(rollout.output_ids) == 12 and rollout.finish_reason == "length"
        assert_matches_trainer(rollout, 0.7)
    # different samples for identical prompts (the sampler's key advances)
    same = engine.generate([Request(PROMPTS[0], params) for _ in range(4)])
    assert len({r.output_ids for r in same}) > 1


def test_streamed_and_plain_greedy_outputs_agree(server):
    """Plain, streamed token by token, and streamed 4 tokens per event (the last event short):
    the same tokens and the trainer's log-probs."""
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    outputs = {}
    for stream, interval in ((False, 1), (True, 1), (True, 4)):
        thread = EngineThread(SGLangEngine([server], stream=stream, stream_interval=interval))
        outputs[stream, interval] = thread.generate([Request(p, params) for p in PROMPTS[:4]])
        thread.close()
    for a, b, c in zip(outputs[False, 1], outputs[True, 1], outputs[True, 4]):
        assert a.output_ids == b.output_ids == c.output_ids
        for x in (a, b, c):
            assert_matches_trainer(x, 1.0)


def test_stop_token_ends_the_rollout_and_is_kept(engine):
    free = engine.generate([Request(PROMPTS[1], SamplingParams(max_new_tokens=10, temperature=0.0))])[0]
    k = next(i for i in range(1, 10) if free.output_ids[i] not in free.output_ids[:i])
    stop = free.output_ids[k]
    stopped = engine.generate([Request(PROMPTS[1], SamplingParams(max_new_tokens=10, temperature=0.0,
                                                                  stop_token_ids=(stop,)))])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids == free.output_ids[:k + 1]
    assert_matches_trainer(stopped, 1.0)


def test_teacher_scoring_equals_the_trainers_logprobs(engine):
    sequences = [list(p) + [40, 41, 42] for p in PROMPTS[:3]]
    scores = engine.run(engine.engine.score(sequences))
    for seq, got in zip(sequences, scores):
        ours = trainer_logprobs(MODEL, (seq[0],), tuple(seq[1:]), 1.0)
        np.testing.assert_allclose(got, ours, atol=1e-4)



def test_abort_mid_stream_ends_with_the_tokens_so_far(engine):
    long = Request(PROMPTS[2], SamplingParams(max_new_tokens=400, temperature=1.0))
    future = engine.submit(collect(engine.engine, [long]))
    wait_for_tokens(engine.engine, [long.request_id])
    engine.run(engine.engine.abort([long.request_id]))
    (rollout,) = future.result(60)
    assert rollout.finish_reason == "abort" and 0 < len(rollout.output_ids) < 400
    assert_matches_trainer(rollout, 1.0)



def test_pause_holds_new_requests_and_resumes_interrupted_ones(engine):
    sglang = engine.engine
    long = Request(PROMPTS[3], SamplingParams(max_new_tokens=120, temperature=1.0))
    in_flight = engine.submit(collect(sglang, [long]))
    wait_for_tokens(sglang, [long.request_id])
    engine.run(sglang.pause())
    waiting = engine.submit(collect(sglang, [Request(PROMPTS[4], SamplingParams(max_new_tokens=4))]))
    time.sleep(1.5)
    assert not waiting.done() and not in_flight.done()
    engine.run(sglang.resume())
    (resumed,) = in_flight.result(120)
    (later,) = waiting.result(120)
    assert later.finish_reason == "length" and len(later.output_ids) == 4
    # cut by the pause, continued from its own tokens: the full budget, logprobs still exact
    assert sglang.stats.interrupted >= 1
    assert resumed.finish_reason == "length" and len(resumed.output_ids) == 120
    assert_matches_trainer(resumed, 1.0)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_every_prompt_is_accounted_for_under_injected_faults(server, stream):
    proxy = FaultProxy(server, ["ok", "reset", "503", "cut", "garbage", "delay", "500", "ok", "ok"])
    thread = EngineThread(SGLangEngine([proxy.url], stream=stream, max_retries=8, backoff_s=0.05,
                                       max_backoff_s=0.2, request_timeout_s=60))
    try:
        requests = [Request(p, SamplingParams(max_new_tokens=8, temperature=0.7), {"i": i})
                    for i, p in enumerate(PROMPTS)]
        completions = thread.generate(requests)
    finally:
        thread.close()
        proxy.close()
    assert [c.request_id for c in completions] == [r.request_id for r in requests]
    assert all(isinstance(c, Rollout) for c in completions), [c.error for c in completions if isinstance(c, Failure)]
    for c in completions:
        assert len(c.output_ids) == 8 and c.finish_reason == "length"
        assert_matches_trainer(c, 0.7)
    assert thread.engine.stats.retries >= sum(f not in ("ok", "delay") for f in proxy.calls) > 0


def test_a_server_that_always_fails_gives_one_failure_per_prompt(server):
    proxy = FaultProxy(server, ["503"])
    thread = EngineThread(SGLangEngine([proxy.url], max_retries=2, backoff_s=0.01, max_backoff_s=0.02))
    try:
        requests = [Request(p, SamplingParams(max_new_tokens=4)) for p in PROMPTS[:6]]
        completions = thread.generate(requests)
    finally:
        thread.close()
        proxy.close()
    assert [c.request_id for c in completions] == [r.request_id for r in requests]
    assert all(isinstance(c, Failure) and "503" in c.error and c.attempts == 3 for c in completions)
    assert len(proxy.calls) == 3 * len(requests)


def test_servers_that_boot_after_the_trainer_are_waited_for(server):
    # a cluster's servers start beside the trainer: nothing answers at the URL yet, then it does
    port = free_port()
    thread = EngineThread(SGLangEngine([f"http://127.0.0.1:{port}"], wait_for_servers_s=120))
    proxy = None
    try:
        started = thread.start()
        time.sleep(2.0)
        assert not started.done()
        proxy = FaultProxy(server, ["ok"], port=port)
        started.result(timeout=60)
        (rollout,) = thread.generate([Request(PROMPTS[0], SamplingParams(max_new_tokens=4, temperature=1.0))])
        assert_matches_trainer(rollout, 1.0)
    finally:
        thread.close()
        if proxy is not None:
            proxy.close()
    impatient = EngineThread(SGLangEngine([f"http://127.0.0.1:{free_port()}"], wait_for_servers_s=1.0))
    try:
        began = time.monotonic()
        with pytest.raises(EngineError, match="no server answered its health check at .* within 1 s"):
            impatient.start().result(timeout=60)
        assert time.monotonic() - began >= 1.0
    finally:
        impatient.close()


def test_a_bad_request_fails_at_once_with_the_servers_message(engine):
    (failure,) = engine.generate([Request((5, 6, 7), SamplingParams(max_new_tokens=4000))])
    assert isinstance(failure, Failure) and failure.attempts == 1
    assert "4000" in failure.error or "context" in failure.error.lower() or "length" in failure.error.lower()


def test_an_episodes_next_turn_hits_the_servers_radix_cache(engine):
    """A turn's prompt extends the last one with the same ids (prompt + output + observation), so
    the server finds the past in its radix cache: the share of prompt tokens it reports as cached
    (meta_info.cached_tokens), which the bridge passes on as prefix_hit_frac."""
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    rng = np.random.default_rng(3)
    prompts = [tuple(int(t) for t in rng.integers(3, 60, 48)) for _ in range(4)]
    engine.metrics()  # start counting here
    first = engine.generate([Request(p, params, session=f"episode-{i}") for i, p in enumerate(prompts)])
    cold = engine.metrics()
    turn = [r.prompt_ids + r.output_ids + (7, 8, 9) for r in first]
    engine.generate([Request(p, params, session=f"episode-{i}") for i, p in enumerate(turn)])
    warm = engine.metrics()
    # measured here: cold 0.00 (4 new prompts), warm 0.93: 55 of each 59-token prompt found cached
    assert cold.get("prefix_hit_frac", 0.0) < 0.2, cold
    assert warm["prefix_hit_frac"] > 0.8, warm
