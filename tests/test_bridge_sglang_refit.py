"""Weight refit and crashes against the real sglang-jax server. sglang-jax has no
update_weights_from_disk, so refit='auto' restarts the server on the new directory: the served
weights and the version change, rollouts cut by the refit are resumed and carry both versions,
and a server killed mid-request is relaunched by supervision while its requests are retried."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from sglang_setup import collect, running_servers, save_tiny, tiny_model, trainer_logprobs, wait_for_tokens

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
                                       for p in PROMPTS]), timeout=300)
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


def test_a_server_killed_mid_request_is_relaunched_and_its_requests_retried(launched):
    group, loop, _ = launched
    engine = SGLangEngine(servers=group, max_retries=50, backoff_s=0.5, max_backoff_s=2.0)
    requests = [Request(p, SamplingParams(max_new_tokens=100, temperature=1.0)) for p in PROMPTS]
    future = loop.submit(collect(engine, requests))
    wait_for_tokens(engine, [requests[0].request_id])
    crashes = group.crashes()
    group.kill(group.urls[0])
    done = future.result(600)
    assert sorted(c.request_id for c in done) == sorted(r.request_id for r in requests)
    assert all(isinstance(c, Rollout) and len(c.output_ids) == 100 for c in done)
    assert group.crashes() == crashes + 1 and engine.stats.retries >= 1
    loop.run(engine.close())
