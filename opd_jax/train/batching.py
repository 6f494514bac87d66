"""Rollouts from any engine into the trainer's RolloutBatch: prompt + response right-padded,
engine log-probs aligned with the tokens they score, the rewards of the decoded responses, and
the configured treatment of responses cut at max_new_tokens."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from opd_jax.core import RolloutBatch
from opd_jax.data import Example
from opd_jax.models import Tokenizer
from opd_jax.rewards import RewardFn, compute_rewards
from rollout_bridge.records import Rollout


def response_text(tokenizer: Tokenizer, rollout: Rollout) -> str:
    return tokenizer.decode(list(rollout.output_ids), skip_special_tokens=True)


def rollout_rewards(rollouts: Sequence[Rollout], examples: Sequence[Example], tokenizer: Tokenizer,
                    reward_fn: RewardFn | None = None, *, on_bad: str = "fail") -> np.ndarray:
    """The reward of each rollout's decoded response (`opd_jax.rewards.compute_rewards`; NaN for
    a bad sample under on_bad="skip")."""
    return compute_rewards([response_text(tokenizer, r) for r in rollouts], examples, reward_fn, on_bad=on_bad)


def drop_bad_rewards(rewards: np.ndarray, response_mask: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows whose reward is NaN (a bad sample, skipped) leave the loss: their response mask is
    zeroed and their reward set to the mean of their group's good rows (0 if none), so the group
    baseline is that of the good rows. Returns (rewards, response_mask), new arrays."""
    rewards, mask = np.array(rewards, np.float32), np.array(response_mask)
    bad = np.isnan(rewards)
    if bad.any():
        groups = rewards.reshape(-1, group_size)
        good = ~np.isnan(groups)
        good_mean = np.where(good, groups, 0).sum(1, keepdims=True) / np.maximum(good.sum(1, keepdims=True), 1)
        rewards = np.where(bad, np.broadcast_to(good_mean, groups.shape).reshape(-1), rewards).astype(np.float32)
        mask[bad] = 0
    return rewards, mask


def batch_length(lengths: Sequence[int], multiple: int = 32) -> int:
    """Padded length for a batch: the longest prompt + response, rounded up (few recompiles)."""
    return multiple * math.ceil(max(lengths) / multiple)


def pack(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, pad_id: int,
         length: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, attention_mask, response_mask), each [B, length]: prompt + response right-padded,
    the response mask 1 on the response's positions."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    length = length or batch_length(lengths)
    B = len(lengths)
    tokens = np.full((B, length), pad_id, np.int32)
    attention = np.zeros((B, length), np.int32)
    response = np.zeros((B, length), np.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if len(p) + len(r) > length:
            raise ValueError(f"sample {i} has {len(p) + len(r)} tokens, more than the batch length {length}")
        tokens[i, :len(p) + len(r)] = [*p, *r]
        attention[i, :len(p) + len(r)] = 1
        response[i, len(p):len(p) + len(r)] = 1
    return tokens, attention, response


def rollouts_to_batch(rollouts: Sequence[Rollout], rewards: np.ndarray, *, pad_id: int, length: int | None = None,
                      truncated: str = "keep", truncation_penalty: float = 0.0) -> RolloutBatch:
    """tokens = prompt + output (right padding), response_mask = 1 on output tokens (the stop
    token included), logp_infer = the engine's log-prob at the same positions. Responses cut at
    max_new_tokens ("length"): "keep" trains on them as they are, "mask" drops them from the
    loss, "penalize" sets their reward to truncation_penalty. Empty responses carry no tokens.
    Rollouts of a MoE engine bring their expert ids (routing, -1 past each row's tokens)."""
    if truncated not in ("keep", "mask", "penalize"):
        raise ValueError(f"truncated must be 'keep', 'mask' or 'penalize', got {truncated!r}")
    tokens, attention, response = pack([r.prompt_ids for r in rollouts], [r.output_ids for r in rollouts],
                                       pad_id=pad_id, length=length)
    logp = np.zeros(response.shape, np.float32)
    rewards = np.asarray(rewards, np.float32).copy()
    routed = [r.routed_experts for r in rollouts]
    routing = None
    if all(x is not None for x in routed) and routed:  # a MoE engine's expert ids, for routing replay
        routing = np.full((*response.shape, *np.shape(routed[0])[1:]), -1, np.int32)
    for i, r in enumerate(rollouts):
        p, n = len(r.prompt_ids), len(r.output_ids)
        logp[i, p:p + n] = r.output_logprobs
        if routing is not None:
            routing[i, :len(routed[i])] = routed[i]
        if r.finish_reason == "length":
            if truncated == "mask":
                response[i] = 0
            elif truncated == "penalize":
                rewards[i] = truncation_penalty
    return RolloutBatch(tokens=jnp.asarray(tokens), attention_mask=jnp.asarray(attention),
                        response_mask=jnp.asarray(response), logp_infer=jnp.asarray(logp),
                        rewards=jnp.asarray(rewards), routing=None if routing is None else jnp.asarray(routing))
