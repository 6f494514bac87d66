"""Parsing SGLang responses: cumulative and incremental stream events give the same rollout;
malformed responses are named."""

from __future__ import annotations

import pytest

from rollout_bridge import sglang_api as api
from rollout_bridge.records import Request, SamplingParams


def event(ids, finish=None, completion=None):
    return {"output_ids": ids, "meta_info": {
        "output_token_logprobs": [[-0.1 * t, t, None] for t in ids], "finish_reason": finish,
        "completion_tokens": len(ids) if completion is None else completion}}


def fold(events):
    so_far = None
    for e in events:
        so_far = api.merge_stream(so_far, api.parse_output(e))
    return so_far


def test_cumulative_and_incremental_streams_agree():
    cumulative = [event([4]), event([4, 4]), event([4, 4, 9], {"type": "stop", "matched": 9})]
    incremental = [event([4]), event([4], completion=2), event([9], {"type": "stop"}, completion=3)]
    a, b = fold(cumulative), fold(incremental)
    assert a.output_ids == b.output_ids == (4, 4, 9) and a.logprobs == b.logprobs
    assert a.finish_reason == b.finish_reason == "stop"


@pytest.mark.parametrize("payload, message", [
    ([], "expected a JSON object"),
    ({"text": "x"}, "no meta_info"),
    ({"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-1.0, 1, None]]}}, "disagree"),
    ({"output_ids": [1], "meta_info": {"output_token_logprobs": [["x"]]}}, "output_token_logprobs"),
    ({"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1.0, 1, None]], "finish_reason": {"type": "odd"}}},
     "unknown type 'odd'"),
])
def test_malformed_responses_are_named(payload, message):
    with pytest.raises(api.ProtocolError, match=message):
        api.parse_output(payload)


def test_server_error_events_are_rejections_not_retries():
    with pytest.raises(api.ServerRejected, match="too long"):
        api.parse_output({"error": {"message": "input is too long"}})


def test_sse_lines():
    assert api.sse_data("data: [DONE]") is api.DONE
    assert api.sse_data(": keep-alive") is None
    with pytest.raises(api.ProtocolError, match="not JSON"):
        api.sse_data("data: {oops")


def test_an_incremental_stream_that_loses_an_event_is_an_error():
    with pytest.raises(api.ProtocolError, match="3 completion tokens, but 2 arrived"):
        fold([event([4]), event([9], completion=3)])


def test_resumed_request_continues_within_its_budget():
    body = api.generate_body(Request((1, 2), SamplingParams(max_new_tokens=10)), "r", stream=False, prefix=(5, 6, 7))
    assert body["input_ids"] == [1, 2, 5, 6, 7] and body["sampling_params"]["max_new_tokens"] == 7
    assert body["sampling_params"]["top_k"] == -1 and body["sampling_params"]["no_stop_trim"] is True


def test_stream_interval_is_asked_for_only_on_streamed_requests():
    request = Request((1, 2), SamplingParams(max_new_tokens=4))
    assert api.generate_body(request, "r", stream=True, stream_interval=8)["sampling_params"]["stream_interval"] == 8
    assert "stream_interval" not in api.generate_body(request, "r", stream=False, stream_interval=8)["sampling_params"]
    assert "stream_interval" not in api.generate_body(request, "r", stream=True)["sampling_params"]


def test_routed_experts_are_asked_for_only_when_replaying():
    request = Request((1, 2), SamplingParams(max_new_tokens=4))
    assert "return_routed_experts" not in api.generate_body(request, "r", stream=True)
    assert api.generate_body(request, "r", stream=True, routed_experts=True)["return_routed_experts"] is True


def test_routed_experts_decode_to_the_moe_layers_of_every_token():
    """SGLang's layout (sgl_jax routed_experts_capturer): int32 [tokens - 1, all layers, k] in
    base64, -1 in dense layers; the last token has not been routed."""
    import base64

    import numpy as np
    rng = np.random.default_rng(0)
    n_tokens, layout = 7, api.RoutingLayout(num_layers=4, moe_layers=(1, 3), k=2)
    sent = rng.integers(0, 8, (n_tokens - 1, 4, 2)).astype(np.int32)
    sent[:, [0, 2]] = -1
    text = base64.b64encode(sent.astype("<i4").tobytes()).decode()
    final = event([4, 9], {"type": "stop"})
    final["meta_info"]["routed_experts"] = text
    out = fold([event([4]), final])  # the last stream event carries them
    got = api.decode_routed_experts(out.routed_experts, n_tokens, layout)
    assert got.shape == (n_tokens, 2, 2) and got.dtype == np.int32
    np.testing.assert_array_equal(got[:-1, 0], sent[:, 1])
    np.testing.assert_array_equal(got[:-1, 1], sent[:, 3])
    assert (got[-1] == -1).all()
    with pytest.raises(api.ProtocolError, match="48 ids; 7 routed tokens x 4 layers x top-2 = 56 expected"):
        api.decode_routed_experts(text, n_tokens + 1, layout)
    with pytest.raises(api.ProtocolError, match="routed_experts is not base64"):
        api.decode_routed_experts("not base64!", n_tokens, layout)
    with pytest.raises(api.ProtocolError, match="routed_experts should be a base64 string"):
        api.parse_output({"output_ids": [], "meta_info": {"routed_experts": [1, 2]}})
