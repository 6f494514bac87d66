"""A trajectory: what the trainer sees of an episode (or of a single-turn rollout). The prompt,
then every token after it as the engine and the environment produced them, which of those the
model wrote (the loss mask), the engine's log-prob of each model token, and each turn's reward
placed on its turn's last model token."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from rollout_bridge.records import Rollout

# done: the environment ended it (the return stops there); truncated: stopped by a budget (turns,
# tokens) or by the environment, so the critic's value of the last state stands in for the rest;
# failed: an environment or engine fault, reported and kept out of the loss
End = Literal["done", "truncated", "failed"]


@dataclasses.dataclass(frozen=True)
class Trajectory:
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]  # every token after the prompt: model turns and observations
    model_mask: tuple[int, ...]  # 1 where response_ids[i] came from the model
    logprobs: tuple[float, ...]  # the engine's log-prob of each model token; 0.0 elsewhere
    turn_ends: tuple[int, ...]  # index in response_ids of each turn's last model token
    turn_rewards: tuple[float, ...]
    end: End
    weight_versions: tuple[int, ...] = ()  # the engine's weight version of each turn
    finish_reasons: tuple[str, ...] = ()  # each turn's: stop, length, or abort (resumed)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None  # what failed, for end == "failed"
    success: bool | None = None  # the environment's info["success"], when it says
    routed_experts: Any = dataclasses.field(default=None, compare=False)  # [prompt + response tokens, layers, k]
    index_offsets: Any = dataclasses.field(default=None, compare=False)  # DSA: [prompt + response tokens, layers, k]

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.model_mask) != n or len(self.logprobs) != n:
            raise ValueError(f"trajectory has {n} response ids, {len(self.model_mask)} mask entries and "
                             f"{len(self.logprobs)} log-probs")
        if len(self.turn_ends) != len(self.turn_rewards):
            raise ValueError(f"{len(self.turn_ends)} turns but {len(self.turn_rewards)} turn rewards")
        if any(not 0 <= i < n or not self.model_mask[i] for i in self.turn_ends):
            raise ValueError("a turn's end is not one of the model's tokens")

    @property
    def reward(self) -> float:
        """The episode's return (γ = 1): the sum of its turns' rewards."""
        return float(sum(self.turn_rewards))

    @property
    def turns(self) -> int:
        return len(self.turn_ends)

    @property
    def weight_version(self) -> int:
        """The oldest weights any of its turns was generated with (staleness counts from it)."""
        return min(self.weight_versions, default=0)

    @property
    def succeeded(self) -> bool:
        return self.success if self.success is not None else self.reward > 0

    @classmethod
    def single_turn(cls, rollout: Rollout, reward: float) -> Trajectory:
        """A one-turn rollout with its outcome reward on its last token. It ends as "done" even
        when cut at max_new_tokens: how such responses train is rollout.truncated's choice (keep,
        mask, penalize), not a bootstrap. An empty response has no turn to carry the reward."""
        n = len(rollout.output_ids)
        return cls(prompt_ids=rollout.prompt_ids, response_ids=rollout.output_ids, model_mask=(1,) * n,
                   logprobs=rollout.output_logprobs, turn_ends=(n - 1,) if n else (),
                   turn_rewards=(float(reward),) if n else (),
                   end="done",
                   weight_versions=(rollout.weight_version,), finish_reasons=(rollout.finish_reason,),
                   metadata=rollout.metadata, routed_experts=rollout.routed_experts,
                   index_offsets=rollout.index_offsets)

    @classmethod
    def failed(cls, prompt_ids: tuple[int, ...], error: str, metadata: dict[str, Any]) -> Trajectory:
        return cls(prompt_ids=prompt_ids, response_ids=(), model_mask=(), logprobs=(), turn_ends=(),
                   turn_rewards=(), end="failed", metadata=metadata, error=error)
