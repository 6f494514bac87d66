"""The loop's side of multi-turn environments: groups of episodes for the rollout pipe, held-out
success through the same engine, and the per-episode metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from opd_jax.config import EpisodeSection
from opd_jax.data import Example
from opd_jax.envs import EpisodeLimits, Trajectory, TurnBatcher, TurnCodec, episode_factory, run_episode
from opd_jax.models import Tokenizer
from opd_jax.train.errors import EvaluationStopped
from rollout_bridge.pipe import EngineThread
from rollout_bridge.records import SamplingParams


def episode_limits(episodes: EpisodeSection, turn_tokens: int) -> EpisodeLimits:
    """The budgets of rollout.episodes, each model turn at most `turn_tokens` (rollout.max_new_tokens)."""
    return EpisodeLimits(max_turns=episodes.max_turns, max_tokens=episodes.max_tokens, turn_tokens=turn_tokens,
                         timeout_s=episodes.timeout_s)


class EpisodePlayer:
    """Plays episodes of the environment sources through one engine; their turns share one
    TurnBatcher, so the episodes of every group in flight are generated together."""

    def __init__(self, engine: EngineThread, tokenizer: Tokenizer, *, chat_template: bool, episodes: EpisodeSection,
                 turn_tokens: int, end_of_turn: int):
        self.engine, self.tokenizer = engine, tokenizer
        self.codec = TurnCodec(tokenizer, chat_template, end_of_turn)
        self.limits = episode_limits(episodes, turn_tokens)
        self._batcher = TurnBatcher(engine.engine)  # used on the engine's loop only

    def _episode(self, example: Example, sampling: SamplingParams, seed: int, metadata: dict[str, Any]):
        return run_episode(episode_factory(example.episode), batcher=self._batcher, codec=self.codec, tokenizer=self.tokenizer,
                           sampling=sampling, limits=self.limits, seed=seed, metadata=metadata)

    def group(self, example: Example, sampling: SamplingParams, seeds: Sequence[int],
              metadata: dict[str, Any]) -> Awaitable[list[Trajectory]]:
        """len(seeds) episodes of one environment instance (a GRPO group), sampled with these seeds;
        booked with the batcher now, so groups drawn together run their rounds together."""
        self.engine.call_soon(self._batcher.expect, len(seeds))

        async def episodes() -> list[Trajectory]:
            return list(await asyncio.gather(*(self._episode(example, sampling, s, metadata) for s in seeds)))
        return episodes()

    def evaluate(self, held_out: dict[str, Sequence[Example]], stop_token_ids: tuple[int, ...],
                 stop: Callable[[], bool] = lambda: False) -> dict[str, float]:
        """Greedy episodes of each environment domain's held-out set: {"eval/<domain>/accuracy":
        the success rate, "eval/<domain>/turns": mean turns, "eval/<domain>/failed": episodes
        that failed (out of the rate)}. `stop()` is asked before each domain (True: EvaluationStopped)."""
        greedy = SamplingParams(max_new_tokens=self.limits.turn_tokens, temperature=0.0, stop_token_ids=stop_token_ids)
        out: dict[str, float] = {}
        for domain, examples in sorted(held_out.items()):
            if stop():
                raise EvaluationStopped

            async def play(examples=examples, domain=domain):
                self._batcher.expect(len(examples))
                return await asyncio.gather(*(self._episode(e, greedy, 0, {"domain": domain}) for e in examples))

            episodes = self.engine.run(play())
            good = [t for t in episodes if t.end != "failed"]
            out[f"eval/{domain}/accuracy"] = float(np.mean([t.succeeded for t in good])) if good else float("nan")
            out[f"eval/{domain}/turns"] = float(np.mean([t.turns for t in good])) if good else float("nan")
            out[f"eval/{domain}/failed"] = float(len(episodes) - len(good))
        return out


def episode_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Turns, tokens, success and per-turn reward of a step's episodes, with the failed ones
    counted (and left out of the means) and per domain success."""
    good = [t for t in trajectories if t.end != "failed"]
    out = {"episodes/failed": float(len(trajectories) - len(good))}
    if not good:
        return out
    out.update({
        "episodes/turns": float(np.mean([t.turns for t in good])),
        "episodes/tokens": float(np.mean([len(t.prompt_ids) + len(t.response_ids) for t in good])),
        "episodes/model_tokens": float(np.mean([sum(t.model_mask) for t in good])),
        "episodes/success": float(np.mean([t.succeeded for t in good])),
        "episodes/turn_reward": float(np.mean([r for t in good for r in t.turn_rewards] or [0.0])),
        "episodes/truncated_frac": float(np.mean([t.end == "truncated" for t in good])),
        "episodes/resumed_turns": float(sum(f == "abort" for t in good for f in t.finish_reasons)),
    })
    for domain in sorted({t.metadata.get("domain", "") for t in good}):
        mine = [t.succeeded for t in good if t.metadata.get("domain", "") == domain]
        out[f"episodes/{domain}/success"] = float(np.mean(mine))
    return out

