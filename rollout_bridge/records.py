"""Sampling parameters of a request and the rollout record an engine returns for it.

The conventions are SGLang's, so a record means the same thing whichever engine produced it:
`output_ids` include the stop token that ended the sequence, and `output_logprobs[i]` is the
log-probability of `output_ids[i]` under log_softmax(logits / temperature) (plain log_softmax of
the logits for greedy decoding), before any top-k / top-p truncation.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k truncation
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer (0 = off), got {self.top_k!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclasses.dataclass(frozen=True)
class Rollout:
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    finish_reason: FinishReason
    weight_version: int = 0
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    request_id: str = ""
    latency_s: float = 0.0  # submit to completion, as the engine's client saw it
    # MoE engines: the expert ids of every prompt and output token, [tokens, MoE layers, k]
    # (SGLang's return_routed_experts; the embedded engine records them), for routing replay
    routed_experts: Any = dataclasses.field(default=None, compare=False)
    # DSA engines (GLM-5): the keys each indexer layer chose for every prompt and output token, as
    # offsets back from the token, [tokens, indexer layers, index_topk] (-1: none), for index replay
    index_offsets: Any = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        if len(self.output_ids) != len(self.output_logprobs):
            raise ValueError(f"rollout has {len(self.output_ids)} output ids but "
                             f"{len(self.output_logprobs)} logprobs")


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request: token ids in (never text), the engine's own ids come back.
    `metadata` (domain, group id, ...) is copied onto the rollout. The embedded engine honours
    `seed` exactly (same seed, same sample, whatever else is batched); SGLang passes it on as
    `sampling_seed`, which sglang-jax 0.0.2 ignores."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    request_id: str = dataclasses.field(default_factory=new_request_id)
    seed: int | None = None  # per-request sampling seed, where the engine honours one
    # requests of one session (an episode's turns, each extending the last) go to the server that
    # served the session before, whose prefix cache holds its past; None: any server
    session: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id}: the prompt is empty")


@dataclasses.dataclass(frozen=True)
class Failure:
    """A request that ended without a rollout: what went wrong after `attempts` tries."""

    request: Request
    error: str
    attempts: int = 1

    @property
    def request_id(self) -> str:
        return self.request.request_id


Completion = Rollout | Failure
