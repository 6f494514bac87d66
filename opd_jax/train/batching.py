"""Rollouts and multi-turn trajectories from any engine into the trainer's RolloutBatch: prompt +
response right-padded, the loss mask on the model's tokens, engine log-probs aligned with the
tokens they score, rewards where they were earned, and the configured treatment of responses cut
at max_new_tokens."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from opd_jax.core import RolloutBatch, UpdateConfig
from opd_jax.core.packing import pack_batch
from opd_jax.data import Example
from opd_jax.envs import Trajectory
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


def pad_rows(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, pad_id: int,
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


def trajectories_to_batch(trajectories: Sequence[Trajectory], *, pad_id: int, length: int | None = None,
                          rewards: Sequence[float] | None = None) -> RolloutBatch:
    """tokens = prompt + every response token (model turns and observations, right padding);
    response_mask = 1 exactly on the model's tokens (the stop tokens included); logp_infer = the
    engine's log-prob there; token_rewards = each turn's reward on its last model token; rewards
    = the episode's return (or `rewards`, one per row); bootstrap = 1 for a truncated episode.
    Rollouts of a MoE engine bring their expert ids (routing), a DSA engine's its chosen keys
    (indices); -1 past what the engine recorded."""
    tokens, attention, _ = pad_rows([t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories],
                                pad_id=pad_id, length=length)
    response = np.zeros(tokens.shape, np.float32)
    logp = np.zeros(tokens.shape, np.float32)
    token_rewards = np.zeros(tokens.shape, np.float32)
    for i, t in enumerate(trajectories):
        p, n = len(t.prompt_ids), len(t.response_ids)
        response[i, p:p + n] = t.model_mask
        logp[i, p:p + n] = t.logprobs
        token_rewards[i, [p + e for e in t.turn_ends]] = t.turn_rewards
    routing, indices = (_recorded([getattr(t, name) for t in trajectories], tokens.shape)
                        for name in ("routed_experts", "index_offsets"))
    returns = np.array([t.reward for t in trajectories] if rewards is None else rewards, np.float32)
    bootstrap = np.array([t.end == "truncated" for t in trajectories], np.float32)
    return RolloutBatch(tokens=jnp.asarray(tokens), attention_mask=jnp.asarray(attention),
                        response_mask=jnp.asarray(response), logp_infer=jnp.asarray(logp),
                        rewards=jnp.asarray(returns), routing=routing, indices=indices,
                        token_rewards=jnp.asarray(token_rewards), bootstrap=jnp.asarray(bootstrap))


def _recorded(per_row: list[Any], shape: tuple[int, int]) -> jax.Array | None:
    """An engine's per-token record (experts, DSA keys) of every row, [B, T, ...], -1 past what it
    recorded; None unless every row has one (for replay)."""
    if not per_row or any(x is None for x in per_row):
        return None
    out = np.full((*shape, *np.shape(per_row[0])[1:]), -1, np.int32)
    for i, x in enumerate(per_row):
        k = min(len(x), shape[1])
        out[i, :k] = np.asarray(x)[:k]
    return jnp.asarray(out)


def truncation_treatment(rollouts: Sequence[Rollout], rewards: np.ndarray, truncated: str = "keep",
                         truncation_penalty: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(rewards, keep) after the configured treatment of responses cut at max_new_tokens
    ("length"): "keep" trains on them as they are, "mask" keeps them out of the loss (keep False),
    "penalize" sets their reward to truncation_penalty."""
    if truncated not in ("keep", "mask", "penalize"):
        raise ValueError(f"truncated must be 'keep', 'mask' or 'penalize', got {truncated!r}")
    rewards = np.asarray(rewards, np.float32).copy()
    cut = np.array([r.finish_reason == "length" for r in rollouts], bool)
    if truncated == "penalize":
        rewards[cut] = truncation_penalty
    return rewards, ~cut if truncated == "mask" else np.ones(len(rollouts), bool)


def without_rows(batch: RolloutBatch, keep: np.ndarray) -> RolloutBatch:
    """The batch with the rows where keep is False out of the loss (response mask zeroed)."""
    if np.all(keep):
        return batch
    return batch.replace(response_mask=jnp.where(jnp.asarray(keep)[:, None], batch.response_mask, 0.0))


def rollouts_to_batch(rollouts: Sequence[Rollout], rewards: np.ndarray, *, pad_id: int, length: int | None = None,
                      truncated: str = "keep", truncation_penalty: float = 0.0) -> RolloutBatch:
    """Single-turn rollouts as one-turn trajectories (`trajectories_to_batch`), the outcome reward
    on the last response token, cut responses treated as `truncation_treatment` says. Empty
    responses carry no tokens."""
    rewards, keep = truncation_treatment(rollouts, rewards, truncated, truncation_penalty)
    batch = trajectories_to_batch([Trajectory.single_turn(r, x) for r, x in zip(rollouts, rewards, strict=True)],
                                  pad_id=pad_id, length=length, rewards=rewards)
    return without_rows(batch, keep)


def packed_for(batch: RolloutBatch, update: UpdateConfig, shards: int) -> RolloutBatch:
    """The batch with a packing plan (`core.packing`) as `update.pack` says (True, False, or
    "auto": when the plan needs fewer rows than the padded batch has), in groups that every split
    of the step keeps whole (the mesh's data shards, mini- and micro-batches)."""
    if update.pack is False:
        return batch
    packed = pack_batch(batch, math.lcm(shards, update.minibatches * update.microbatches), update.pack_row_tokens)
    if update.pack == "auto" and packed_rows(packed) >= batch.tokens.shape[0]:
        return batch  # packing would save no rows, only add its gathers (and a compile)
    return packed


def packed_rows(batch: RolloutBatch) -> int:
    """Rows the forwards of a packed batch run on."""
    per_group, rows_per_group, _ = batch.packing
    return batch.tokens.shape[0] // per_group * rows_per_group
