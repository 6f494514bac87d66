"""SGLang's native HTTP API as data: the request bodies the bridge sends and the parsing of what
comes back. No I/O here, so every rule is tested on its own.

References: SGLang `python/sglang/srt/managers/io_struct.py` (GenerateReqInput,
UpdateWeightFromDiskReqInput, AbortReq) and `entrypoints/http_server.py` (`/generate` streams
`data: {json}` events ending in `data: [DONE]`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from typing import Any

import numpy as np

from opd_jax.errors import OpdJaxError
from rollout_bridge.records import FinishReason, Request


class ProtocolError(OpdJaxError, ValueError):
    """A server response that does not follow SGLang's API; the message says which field."""


class ServerRejected(ProtocolError):
    """The server answered with an error for this request (bad input): retrying cannot help."""


def sampling_params_body(request: Request, max_new_tokens: int | None = None) -> dict[str, Any]:
    """SGLang also stops at the model's own EOS ids (config / generation_config) whatever
    stop_token_ids says, and `ignore_eos` would switch stop_token_ids off too; the training
    loop's stop set always holds the EOS ids, so both engines stop at the same tokens."""
    p = request.params
    body: dict[str, Any] = {
        "max_new_tokens": p.max_new_tokens if max_new_tokens is None else max_new_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else -1,  # SGLang: -1 disables top-k
        "stop_token_ids": list(p.stop_token_ids),
        "no_stop_trim": True,  # keep the stop token: the trainer scores it like every other token
        "skip_special_tokens": False,
    }
    if request.seed is not None:
        body["sampling_seed"] = request.seed
    return body


def generate_body(request: Request, rid: str, *, stream: bool, prefix: tuple[int, ...] = (),
                  routed_experts: bool = False, stream_interval: int = 1) -> dict[str, Any]:
    """`POST /generate` for one request. `prefix`: output tokens already generated (a rollout
    resumed after a refit), appended to the prompt; the budget shrinks by as many tokens.
    `routed_experts`: ask a MoE server for the experts of every token (it must run with
    --enable-return-routed-experts). `stream_interval`: a streamed request's tokens per event."""
    body = {
        "rid": rid,
        "input_ids": [*request.prompt_ids, *prefix],
        "sampling_params": sampling_params_body(request, request.params.max_new_tokens - len(prefix)),
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": stream,
    }
    if routed_experts:
        body["return_routed_experts"] = True
    if stream and stream_interval > 1:
        body["sampling_params"]["stream_interval"] = stream_interval
    return body


def score_body(input_ids: list[int], rid: str) -> dict[str, Any]:
    """Teacher scoring: the log-probability of every given token after the first, no generation."""
    return {"rid": rid, "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True, "logprob_start_len": 0, "stream": False}


def update_weights_body(model_path: str, version: int) -> dict[str, Any]:
    """`POST /update_weights_from_disk` (SGLang's UpdateWeightFromDiskReqInput)."""
    return {"model_path": model_path, "weight_version": str(version), "abort_all_requests": False}


def abort_body(rid: str | None) -> dict[str, Any]:
    return {"rid": "", "abort_all": True} if rid is None else {"rid": rid, "abort_all": False}


@dataclasses.dataclass(frozen=True)
class Output:
    """What one response (or one stream event) says about a request so far."""

    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason | None  # None while a stream is still going
    completion_tokens: int
    weight_version: str | None
    abort_message: str | None = None
    routed_experts: str | None = None  # meta_info.routed_experts as sent (base64), see `decode_routed_experts`
    prompt_tokens: int | None = None  # meta_info.prompt_tokens: the request's prompt
    cached_tokens: int | None = None  # meta_info.cached_tokens: of them, found in the server's radix cache


def _finish(meta: dict[str, Any]) -> tuple[FinishReason | None, str | None]:
    reason = meta.get("finish_reason")
    if reason is None:
        return None, None
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind in ("stop", "length"):
        return kind, None
    if kind == "abort":
        return "abort", reason.get("message") if isinstance(reason, dict) else None
    raise ProtocolError(f"meta_info.finish_reason has unknown type {kind!r}")


def parse_output(payload: Any) -> Output:
    """One `/generate` JSON object: output ids, their logprobs and the finish reason, checked
    against each other (`output_token_logprobs` is [[logprob, token_id, text], ...])."""
    if not isinstance(payload, dict):
        raise ProtocolError(f"expected a JSON object, got {type(payload).__name__}")
    if "error" in payload:
        error = payload["error"]
        raise ServerRejected(f"server error: {error.get('message', error) if isinstance(error, dict) else error}")
    meta = payload.get("meta_info")
    if not isinstance(meta, dict):
        raise ProtocolError("response has no meta_info object")
    finish, abort_message = _finish(meta)
    entries = meta.get("output_token_logprobs") or []
    ids = payload.get("output_ids")
    try:
        pairs = [(float(e[0]), int(e[1])) for e in entries]
    except (TypeError, ValueError, IndexError):
        raise ProtocolError("meta_info.output_token_logprobs is not a list of [logprob, token_id, text]") from None
    if ids is None:
        ids = [t for _, t in pairs]
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise ProtocolError("output_ids is not a list of token ids")
    if len(pairs) != len(ids) or any(t != i for (_, t), i in zip(pairs, ids)):
        raise ProtocolError(f"output_ids ({len(ids)}) and meta_info.output_token_logprobs ({len(pairs)}) "
                            f"disagree")
    completion = meta.get("completion_tokens", len(ids))
    version = meta.get("weight_version")
    routed = meta.get("routed_experts")
    if routed is not None and not isinstance(routed, str):
        raise ProtocolError(f"meta_info.routed_experts should be a base64 string, got {type(routed).__name__}")
    counts = [meta.get(k) for k in ("prompt_tokens", "cached_tokens")]
    prompt_tokens, cached_tokens = (int(v) if isinstance(v, int) and not isinstance(v, bool) else None for v in counts)
    return Output(tuple(ids), tuple(lp for lp, _ in pairs), finish, int(completion),
                  None if version is None else str(version), abort_message, routed, prompt_tokens, cached_tokens)


def merge_stream(so_far: Output | None, event: Output) -> Output:
    """Fold one stream event into what was received before. SGLang streams cumulative events by
    default (each holds everything so far) and incremental ones with
    --incremental-streaming-output; `completion_tokens`, a running total in both, tells which."""
    if so_far is None or event.completion_tokens == len(event.output_ids):
        return event
    ids, logprobs = so_far.output_ids + event.output_ids, so_far.logprobs + event.logprobs
    if len(ids) != event.completion_tokens:
        raise ProtocolError(f"stream event reports {event.completion_tokens} completion tokens, but "
                            f"{len(ids)} arrived")
    return dataclasses.replace(event, output_ids=ids, logprobs=logprobs,
                               routed_experts=event.routed_experts or so_far.routed_experts,
                               prompt_tokens=event.prompt_tokens if event.prompt_tokens is not None else so_far.prompt_tokens,
                               cached_tokens=event.cached_tokens if event.cached_tokens is not None else so_far.cached_tokens)


@dataclasses.dataclass(frozen=True)
class RoutingLayout:
    """How a MoE server lays out `routed_experts`: `num_layers` decoder layers (dense ones
    filled with -1), of which `moe_layers` route, `k` experts per token."""

    num_layers: int
    moe_layers: tuple[int, ...]
    k: int


def decode_routed_experts(text: str, n_tokens: int, layout: RoutingLayout) -> np.ndarray:
    """meta_info.routed_experts: base64 of int32 [n_tokens - 1, num_layers, k] (every token of
    prompt and output but the last, which no forward pass has routed yet), as
    [n_tokens, len(moe_layers), k] with the last token's experts -1 (none recorded)."""
    try:
        flat = np.frombuffer(base64.b64decode(text, validate=True), dtype="<i4")
    except (binascii.Error, ValueError) as e:
        raise ProtocolError(f"meta_info.routed_experts is not base64 of int32 ids ({e})") from None
    per_token = layout.num_layers * layout.k
    if flat.size != (n_tokens - 1) * per_token:
        raise ProtocolError(f"meta_info.routed_experts holds {flat.size} ids; {n_tokens - 1} routed tokens x "
                            f"{layout.num_layers} layers x top-{layout.k} = {(n_tokens - 1) * per_token} expected "
                            f"(is the server's model the policy?)")
    ids = flat.reshape(n_tokens - 1, layout.num_layers, layout.k)[:, list(layout.moe_layers)]
    out = np.full((n_tokens, len(layout.moe_layers), layout.k), -1, np.int32)
    out[:-1] = ids
    return out


def sse_data(line: str) -> Any | None:
    """The JSON of one `data: ...` line, None for other lines; `DONE` for the end marker."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return DONE
    try:
        return json.loads(data)
    except json.JSONDecodeError as e:
        raise ProtocolError(f"stream event is not JSON ({e}): {data[:120]!r}") from None


DONE = object()


def parse_scores(payload: Any, n_tokens: int) -> list[float]:
    """`input_token_logprobs` of a scoring response: logp(token_i | tokens before it) for
    i = 1 .. n-1 (the first token has none)."""
    meta = payload.get("meta_info") if isinstance(payload, dict) else None
    entries = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(entries, list) or len(entries) != n_tokens:
        raise ProtocolError(f"meta_info.input_token_logprobs should hold {n_tokens} entries, got "
                            f"{len(entries) if isinstance(entries, list) else entries!r}")
    try:
        return [float(e[0]) for e in entries[1:]]
    except (TypeError, ValueError, IndexError):
        raise ProtocolError("meta_info.input_token_logprobs is not a list of [logprob, token_id, text]") from None
