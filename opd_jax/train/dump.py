"""logging.dump_rollouts: each step's trajectories as JSONL, one line per row of the batch, for
looking at what the policy was trained on (rollouts/step_000001.jsonl)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from opd_jax.core import RolloutBatch
from opd_jax.envs import Trajectory
from opd_jax.models import Tokenizer


def _local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of a batch-sharded array (each process dumps its own trajectories)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    full = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    n = full.shape[0] // jax.process_count()
    return full[jax.process_index() * n:(jax.process_index() + 1) * n]


def _exact(values: np.ndarray) -> list[float]:
    """float32 values as JSON numbers that read back to the same float32 (9 significant digits)."""
    return [float(f"{v:.9g}") for v in np.asarray(values, np.float32)]


def dump_rollouts(path: Path, step: int, trajectories: Sequence[Trajectory], scored: RolloutBatch,
                  extra: dict[str, jax.Array], tokenizer: Tokenizer) -> None:
    """One JSON object per trajectory: its ids and text, prompt length, loss mask, engine and
    trainer log-probs, token rewards, the return, values and `extra` per-token arrays (the
    advantages and returns the step trained on, as it computed them), each over prompt + response,
    cut at the row's real tokens, as float32 exactly (9 significant digits)."""
    fields = {"logp_engine": scored.logp_infer, "logp_trainer": scored.logp_old, "values": scored.old_values,
              "token_rewards": scored.token_rewards, **extra}
    host = {k: _local_rows(v) for k, v in fields.items() if v is not None}
    mask = _local_rows(scored.response_mask)
    rewards = _local_rows(scored.rewards)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i, t in enumerate(trajectories):
            ids = [*t.prompt_ids, *t.response_ids]
            n = len(ids)
            row: dict[str, Any] = {
                "step": step, "row": i, "domain": t.metadata.get("domain"), "end": t.end, "error": t.error,
                "turns": t.turns, "success": t.succeeded if t.end != "failed" else None,
                "weight_versions": list(t.weight_versions), "prompt_len": len(t.prompt_ids), "token_ids": ids,
                "text": tokenizer.decode(ids), "loss_mask": [int(m) for m in mask[i, :n]],
                "turn_rewards": list(t.turn_rewards), "reward": float(rewards[i]),
                **{k: _exact(v[i, :n]) for k, v in host.items()}}
            f.write(json.dumps(row) + "\n")
