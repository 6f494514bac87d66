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
