"""The embedded engine's prefix cache: the keys and values of token sequences it has already run
(a request's prompt and output), kept so a later request that extends one (an episode's next turn:
the same ids, the observation appended) prefills only what was appended.

A sequence's entry holds its KV for every token (as the engine's cache stores them: its dtype, and
the float8 cache's scales) and, for a MoE model, the experts each token was routed to (routing
replay needs the prompt's too). `match` finds the longest stored sequence that is a proper prefix
of a prompt. Memory is bounded by `capacity` tokens: the least recently used entries are evicted
(a later request that needed one prefills in full, as without the cache). An entry a request
extended is dropped once the extension is stored (an episode goes forward, never back). A weight
update clears the store: KV of old weights never meets new ones.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def prefix_tokens(config: Any, dtype: str, budget_bytes: float) -> int:
    """How many tokens' KV fit in `budget_bytes` for a model of `config` with a KV cache of
    `dtype` (a float8 cache adds its float32 scales)."""
    per_value = np.dtype(jnp.dtype(dtype)).itemsize
    values = 2 * config.num_layers * config.num_kv_heads
    per_token = values * (config.head_dim * per_value + (4 if per_value == 1 else 0))
    return int(budget_bytes // per_token)


@dataclasses.dataclass(frozen=True)
class Prefix:
    """The KV of one token sequence: k, v [layers, n, kv_heads, head_dim]; k_scale, v_scale
    [layers, n, kv_heads] for a float8 cache; routing [n, MoE layers, k] for a MoE model."""

    ids: tuple[int, ...]
    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    routing: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ids)


@dataclasses.dataclass
class PrefixStats:
    prompt_tokens: int = 0  # tokens of the prompts looked up
    hit_tokens: int = 0  # of them, found in the store (not prefilled)
    evictions: int = 0

    def take(self) -> dict[str, float]:
        """The counters since the last take, as engine metrics."""
        out = {"prefix_hit_frac": self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
               "prefix_hit_tokens": float(self.hit_tokens), "prefix_evictions": float(self.evictions)}
        self.prompt_tokens = self.hit_tokens = self.evictions = 0
        return out


@dataclasses.dataclass
class PrefillStats:
    """Prompt tokens a static batch had, and how many it prefilled (the others were shared with
    an equal prompt of the batch or found in the prefix store)."""

    prompt_tokens: int = 0
    prefilled_tokens: int = 0

    def add(self, prompt_tokens: int, prefilled_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.prefilled_tokens += prefilled_tokens

    def take(self) -> dict[str, float]:
        out = {"prefill_saved_frac": 1.0 - self.prefilled_tokens / self.prompt_tokens if self.prompt_tokens else 0.0}
        self.prompt_tokens = self.prefilled_tokens = 0
        return out


class PrefixStore:
    """Sequences' KV by their token ids, least recently used first; at most `capacity` tokens."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"the prefix cache's capacity must be >= 0 tokens, got {capacity}")
        self.capacity = capacity
        self._entries: collections.OrderedDict[tuple[int, ...], Prefix] = collections.OrderedDict()
        self._lengths: collections.Counter[int] = collections.Counter()
        self.tokens = 0
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: Sequence[int]) -> Prefix | None:
        """The longest stored sequence that is a proper prefix of `prompt` (at least one token is
        left to prefill), counted in the hit statistics; None if there is none."""
        prompt = tuple(prompt)
        self.stats.prompt_tokens += len(prompt)
        for n in sorted(self._lengths, reverse=True):
            if n < len(prompt):
                entry = self._entries.get(prompt[:n])
                if entry is not None:
                    self._entries.move_to_end(entry.ids)
                    self.stats.hit_tokens += n
                    return entry
        return None

    def add(self, entry: Prefix, *, extends: Prefix | None = None) -> None:
        """Keep `entry` (the most recently used); drop `extends`, the entry it grew from, and
        the least recently used ones while over capacity."""
        if extends is not None:
            self._drop(extends.ids)
        if len(entry) > self.capacity:
            return
        self._drop(entry.ids)
        self._entries[entry.ids] = entry
        self._lengths[len(entry)] += 1
        self.tokens += len(entry)
        while self.tokens > self.capacity:
            self._drop(next(iter(self._entries)))
            self.stats.evictions += 1

    def _drop(self, ids: tuple[int, ...]) -> None:
        entry = self._entries.pop(ids, None)
        if entry is not None:
            self.tokens -= len(entry)
            self._lengths[len(entry)] -= 1
            if not self._lengths[len(entry)]:
                del self._lengths[len(entry)]

    def clear(self) -> None:
        """Forget every entry (new weights: their KV would be of the old ones)."""
        self._entries.clear()
        self._lengths.clear()
        self.tokens = 0
