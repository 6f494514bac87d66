"""The batch the PPO step trains on, and its host-side check (bad numbers never reach training).

Every per-token array is [B, T] over the same token positions as `tokens` (prompt + response,
padding at the end of each row). Per-token log-probabilities and values are aligned with the
token they score: logp[b, t] = log π(tokens[b, t] | tokens[b, :t]), so a response mask selects
the same positions in all of them.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from opd_jax.errors import OpdJaxError


class BatchError(OpdJaxError, ValueError):
    """A batch that cannot be trained on; the message names the field and the sample indices."""


@flax.struct.dataclass
class RolloutBatch:
    """tokens: int32 [B, T]; attention_mask: [B, T], 1 on real (prompt and response) tokens;
    response_mask: [B, T], 1 on the response tokens that count in the loss; logp_infer: [B, T],
    the engine's log-prob of each response token; rewards: [B], the outcome reward.
    Filled by `score_batch` before the step: logp_old (θ_old log-probs) and old_values (critic
    values V(prefix before t)), both [B, T]. logp_ref: [B, T] log-probs under a frozen reference,
    only needed when a KL term is on. routing: int32 [B, T, MoE layers, k], the experts a MoE
    engine used for each token (-1 where it recorded none), for routing replay. indices: int32
    [B, T, indexer layers, k], the keys a DSA engine attended for each token, as offsets back
    (`models.mla.key_offsets`; -1: none), for index replay.
    Multi-turn episodes: token_rewards [B, T], each turn's reward on its last model token (without
    it, the outcome reward sits on the last response token); bootstrap [B], 1 for an episode cut
    short (the critic's value of its final state, end_values [B] from `score_batch`, continues
    the return) and 0 for one that ended.
    Packing (`core.packing`): pack_row, pack_offset [B] place each row in fewer packed rows for
    the forwards; packing = (seqs_per_group, rows_per_group, row_len) is their static layout.
    Without them the forwards run on the padded rows."""

    tokens: jax.Array
    attention_mask: jax.Array
    response_mask: jax.Array
    logp_infer: jax.Array
    rewards: jax.Array
    logp_old: jax.Array | None = None
    old_values: jax.Array | None = None
    logp_ref: jax.Array | None = None
    routing: jax.Array | None = None
    indices: jax.Array | None = None
    token_rewards: jax.Array | None = None
    bootstrap: jax.Array | None = None
    end_values: jax.Array | None = None
    pack_row: jax.Array | None = None
    pack_offset: jax.Array | None = None
    packing: tuple[int, int, int] | None = flax.struct.field(pytree_node=False, default=None)

    def unpacked(self) -> RolloutBatch:
        """The batch without its packing plan (forwards on padded rows): for a pass that takes
        arbitrary subsets of rows, which would cut the plan's groups."""
        return self.replace(pack_row=None, pack_offset=None, packing=None)

    @property
    def positions(self) -> jax.Array:
        """Position ids counted over real tokens (0, 1, ... from each row's first real token)."""
        return jnp.maximum(jnp.cumsum(self.attention_mask.astype(jnp.int32), axis=1) - 1, 0)


_TOKEN_FIELDS = ("attention_mask", "response_mask", "logp_infer", "logp_old", "old_values", "logp_ref", "token_rewards")
_ROW_FIELDS = ("rewards", "bootstrap", "end_values", "pack_row", "pack_offset")
_FLOAT_FIELDS = ("logp_infer", "logp_old", "old_values", "logp_ref")


def _rows(bad: np.ndarray, limit: int = 8) -> str:
    idx = np.flatnonzero(bad)
    shown = ", ".join(map(str, idx[:limit])) + (f", ... ({len(idx)} in all)" if len(idx) > limit else "")
    return f"sample{'s' if len(idx) > 1 else ''} {shown}"


def validate_batch(batch: RolloutBatch, *, vocab_size: int | None = None, need_old: bool = False) -> None:
    """Raise BatchError naming the field and the sample indices when the batch has the wrong
    shapes, a response token outside the attention mask, a token id outside the vocabulary, or a
    NaN/inf (or a positive log-probability) where it would be trained on. Host-side NumPy: call it
    on each process's local rows before they are sharded."""
    host: dict[str, Any] = {f: None if getattr(batch, f) is None else np.asarray(getattr(batch, f))
                            for f in ("tokens", *_ROW_FIELDS, *_TOKEN_FIELDS)}
    tokens = host["tokens"]
    if tokens.ndim != 2:
        raise BatchError(f"tokens must be [batch, length], got shape {tokens.shape}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise BatchError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    for name in _TOKEN_FIELDS:
        if host[name] is not None and host[name].shape != tokens.shape:
            raise BatchError(f"{name} has shape {host[name].shape} but tokens have {tokens.shape}")
    for name in _ROW_FIELDS:
        if host[name] is not None and host[name].shape != tokens.shape[:1]:
            raise BatchError(f"{name} must be one per sample, shape {tokens.shape[:1]}, got {host[name].shape}")
    if need_old and (host["logp_old"] is None or host["old_values"] is None):
        raise BatchError("logp_old and old_values are missing: run score_batch on the batch first")
    resp = host["response_mask"].astype(bool)
    real = host["attention_mask"].astype(bool)
    if np.any(resp & ~real):
        raise BatchError(f"response_mask is 1 outside attention_mask at {_rows(np.any(resp & ~real, 1))}")
    if vocab_size is not None:
        out = ((tokens < 0) | (tokens >= vocab_size)) & real
        if np.any(out):
            raise BatchError(f"token ids outside the vocabulary [0, {vocab_size}) at {_rows(np.any(out, 1))}")
    if not np.all(np.isfinite(host["rewards"])):
        raise BatchError(f"rewards are NaN or inf at {_rows(~np.isfinite(host['rewards']))}")
    if host["token_rewards"] is not None and not np.all(np.isfinite(host["token_rewards"])):
        raise BatchError(f"token_rewards are NaN or inf at {_rows(~np.all(np.isfinite(host['token_rewards']), 1))}")
    for name in _FLOAT_FIELDS:
        values = host[name]
        if values is None:
            continue
        bad = resp & ~np.isfinite(values)
        if np.any(bad):
            raise BatchError(f"{name} is NaN or inf on response tokens of {_rows(np.any(bad, 1))}")
        if name != "old_values":
            positive = resp & (values > 1e-3)
            if np.any(positive):
                raise BatchError(f"{name} holds positive log-probabilities on response tokens of "
                                 f"{_rows(np.any(positive, 1))}")
