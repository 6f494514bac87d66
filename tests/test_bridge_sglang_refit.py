"""Weight refit and crashes against the real sglang-jax server. sglang-jax has no
update_weights_from_disk, so refit='auto' restarts the server on the new directory: the served
weights and the version change, rollouts cut by the refit are resumed and carry both versions,
a server killed mid-request is relaunched by supervision while its requests are retried, and
multi-turn episodes go on through both."""

from __future__ import annotations

import asyncio
import functools
import time

import httpx
import numpy as np
import pytest
from sglang_setup import TOKENIZER, collect, running_servers, save_tiny, tiny_model, trainer_logprobs, wait_for_tokens

from opd_jax.envs import EpisodeLimits, TurnBatcher, TurnCodec, run_episode
from opd_jax.envs.gridworld import GridworldEnv
from rollout_bridge.protocol import EngineError, WeightUpdate
from rollout_bridge.records import Request, Rollout, SamplingParams
from rollout_bridge.sglang_engine import SGLangEngine

OLD, NEW = tiny_model(0), tiny_model(1)
PROMPTS = [tuple(range(4 + i, 11 + i)) for i in range(6)]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_refit")
    with running_servers(save_tiny(root / "model", 0), root / "logs") as (group, loop):
        yield group, loop, root




def test_restart_refit_serves_the_new_weights_under_the_new_version(launched):
    group, loop, root = launched
    engine = SGLangEngine(servers=group, refit="auto", refit_dir=root / "refit")
    # the engine's own thread would not host the group's supervision; share the group's loop
    long = [Request(p, SamplingParams(max_new_tokens=300, temperature=1.0)) for p in PROMPTS[:2]]
    in_flight = loop.submit(collect(engine, long))
    wait_for_tokens(engine, [r.request_id for r in long])
    update = WeightUpdate(1, save_hf=lambda d: save_tiny(d, 1))
    loop.run(engine.update_weights(update), timeout=600)
    assert engine.weight_version == 1 and engine.stats.refits == 1
    info = httpx.get(group.urls[0] + "/get_model_info").json()
    assert info["model_path"] == str((root / "refit" / "v1").resolve())

    fresh = loop.run(collect(engine, [Request(p, SamplingParams(max_new_tokens=10, temperature=0.7))
                                       for p in PROMPTS]), timeout=1200)
    for r in fresh:
        assert r.weight_version == 1
        np.testing.assert_allclose(r.output_logprobs, trainer_logprobs(NEW, r.prompt_ids, r.output_ids, 0.7), atol=1e-4)
        assert np.abs(np.asarray(r.output_logprobs) - trainer_logprobs(OLD, r.prompt_ids, r.output_ids, 0.7)).max() > 1e-3

    # the rollouts the restart cut: resumed on the new server, tagged with both versions, each
    # token's logprob from the weights that sampled it
    for r in in_flight.result(300):
        assert isinstance(r, Rollout) and len(r.output_ids) == 300
        assert r.weight_version == 0 and r.metadata["weight_versions"] == [0, 1]
        old = trainer_logprobs(OLD, r.prompt_ids, r.output_ids, 1.0)
        new = trainer_logprobs(NEW, r.prompt_ids, r.output_ids, 1.0)
        served = np.asarray(r.output_logprobs)
        by_old = np.abs(served - old) < 1e-4
        by_new = np.abs(served - new) < 1e-4
        split = int(np.argmin(by_old)) if not by_old.all() else len(served)
        assert 0 < split < len(served) and by_old[:split].all() and by_new[split:].all()
    loop.run(engine.close())


def test_refit_disk_mode_names_the_missing_endpoint(launched):
    group, loop, root = launched
    engine = SGLangEngine(group.urls, refit="disk", refit_dir=root / "refit_disk")
    with pytest.raises(EngineError, match="update_weights_from_disk"):
        loop.run(engine.update_weights(WeightUpdate(7, save_hf=lambda d: save_tiny(d, 0))), timeout=120)
    # the failed refit left the server running and generating
    (r,) = loop.run(collect(engine, [Request(PROMPTS[0], SamplingParams(max_new_tokens=3))]), timeout=120)
    assert isinstance(r, Rollout) and engine.weight_version == 0
    loop.run(engine.close())


def test_episodes_go_on_through_a_refit_and_a_crash_mid_episode(launched):
    """Multi-turn episodes (random gridworld play) through the server while it is refitted by
    restart after their first turns, then killed mid-turn: no turn is dropped and no episode
    fails; the turn in flight at the refit is resumed on the new weights and the crashed one
    retried; each model token's log-prob is that of the weights that sampled it, and each
    trajectory's turns carry versions 0 then 1."""
    group, loop, root = launched
    engine = SGLangEngine(servers=group, refit="auto", refit_dir=root / "refit_episodes", max_retries=50,
                          backoff_s=0.5, max_backoff_s=2.0)
    turns_done = []

    class Counting:  # the engine as the episodes see it, counting the turns it hands back
        async def stream(self, requests):
            async for completion in engine.stream(requests):
                turns_done.append(completion)
                yield completion

    batcher, codec = TurnBatcher(Counting()), TurnCodec(TOKENIZER, False)
    limits = EpisodeLimits(max_turns=4, max_tokens=480, turn_tokens=40, timeout_s=5)
    sampling = SamplingParams(max_new_tokens=40, temperature=1.0)

    async def episodes():
        batcher.expect(4)
        return await asyncio.gather(*(run_episode(functools.partial(GridworldEnv, s, max_moves=40), batcher=batcher,
                                                  codec=codec, tokenizer=TOKENIZER, sampling=sampling, limits=limits,
                                                  seed=s, metadata={}) for s in range(4)))

    def in_flight_after(completed: int) -> None:
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline:
            partial = [f.partial for f in list(engine._flights.values())]
            if len(turns_done) >= completed and any(p is not None and p.output_ids for p in partial):
                return
            time.sleep(0.02)
        raise AssertionError(f"no turn in flight after {completed} completed turns")

    # the server serves seed 0's weights, or seed 1's if the refit test ran first; the refit here
    # brings seed 2's
    served = httpx.get(group.urls[0] + "/get_model_info").json()["model_path"]
    before, after = (NEW if served.endswith("/v1") else OLD), tiny_model(2)
    future = loop.submit(episodes())
    in_flight_after(4)  # the first round done, the second streaming
    loop.run(engine.update_weights(WeightUpdate(1, save_hf=lambda d: save_tiny(d, 2))), timeout=600)
    crashes = group.crashes()
    in_flight_after(12)  # the third round streaming on the new weights
    group.kill(group.urls[0])
    trajectories = future.result(900)
    assert group.crashes() == crashes + 1 and engine.stats.retries >= 1 and engine.stats.interrupted >= 1
    for t in trajectories:
        assert t.end == "truncated" and t.turns == 4 and t.error is None, t.error
        assert list(t.weight_versions) == sorted(t.weight_versions) and set(t.weight_versions) == {0, 1}
        mask = np.asarray(t.model_mask, bool)
        served = np.asarray(t.logprobs)[mask]
        old = trainer_logprobs(before, t.prompt_ids, t.response_ids, 1.0)[mask]
        new = trainer_logprobs(after, t.prompt_ids, t.response_ids, 1.0)[mask]
        by_old, by_new = np.abs(served - old) < 1e-4, np.abs(served - new) < 1e-4
        split = int(np.argmin(by_old)) if not by_old.all() else len(served)
        assert 0 < split < len(served) and by_old[:split].all() and by_new[split:].all()
    loop.run(engine.close())
