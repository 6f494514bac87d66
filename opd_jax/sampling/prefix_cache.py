"""The embedded engine's prefix cache: the keys and values of token sequences it has already run
(a request's prompt and output), kept so a later request that extends one (an episode's next turn:
the same ids, the observation appended) prefills only what was appended.

A sequence's entry holds its KV for every token (as the engine's cache stores them: its dtype, and
the float8 cache's scales) and what each token chose (`sampling.choices`: a MoE model's experts,
a DSA model's keys; replay needs the prompt's too). `match` finds the longest stored sequence that is a proper prefix
of a prompt. Memory is bounded by `capacity` tokens: the least recently used entries are evicted
(a later request that needed one prefills in full, as without the cache). An entry is dropped
once every request that stored it has been extended by its own next request or released (its
episode ended: `release`), as an episode goes forward, never back; two episodes with the same
past each hold it once, so whether a turn finds its past never depends on the order requests
arrived in. A weight update clears the
store: KV of old weights never meets new ones.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from opd_jax.models.decoder import KVCache
from opd_jax.sampling.ops import bucket


def shared_prompts(prompts: Sequence[Sequence[int]], share: bool) -> tuple[np.ndarray, list[list[int]]]:
    """(row_of, unique): each prompt's row among the prompts to prefill, and those prompts. With
    `share` (the prefix cache on), equal prompts prefill once; without, each is its own row."""
    if not share:
        return np.arange(len(prompts), dtype=np.int32), [list(p) for p in prompts]
    rows: dict[tuple[int, ...], int] = {}
    row_of = np.array([rows.setdefault(tuple(p), len(rows)) for p in prompts], np.int32)
    return row_of, [list(p) for p in rows]


def prefix_tokens(config: Any, dtype: str, budget_bytes: float) -> int:
    """How many tokens' KV fit in `budget_bytes` for a model of `config` with a KV cache of
    `dtype` (a float8 cache adds its float32 scales)."""
    per_value = np.dtype(jnp.dtype(dtype)).itemsize
    per_token = config.num_layers * sum(heads * (width * per_value + (4 if per_value == 1 else 0))
                                        for heads, width in config.cache_entries)
    return int(budget_bytes // per_token)


@dataclasses.dataclass(frozen=True)
class Prefix:
    """The KV of one token sequence: k, v [layers, n, heads, width] (`ModelConfig.cache_entries`);
    k_scale, v_scale [layers, n, heads] for a float8 cache; routing: each recorded choice [n, ...]
    (`sampling.choices`: a MoE model's experts, a DSA model's keys)."""

    ids: tuple[int, ...]
    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    routing: dict[str, np.ndarray] | None = None  # the tokens' recorded choices (`sampling.choices`)

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


def token_flops(config: Any) -> tuple[float, float]:
    """A decoder's forward FLOPs for one token: (fixed: 2 × the projection and MLP weights it
    multiplies, experts_per_token experts' for a MoE layer; per attended key: 4 × heads × head_dim,
    over all layers). The output head is left out: a prefill needs it at one position only."""
    c = config
    projections = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    per_key = 4 * c.num_heads * c.head_dim
    if c.mla is not None:  # MLA's low-rank projections; per key, absorbed: a latent and rotary key read twice
        m = c.mla
        projections = (c.hidden_size * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim)
                       + m.q_lora_rank * c.num_heads * m.qk_head_dim
                       + m.kv_lora_rank * c.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
                       + c.num_heads * m.v_head_dim * c.hidden_size)
        per_key = 2 * c.num_heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim)
    dense_mlp = 3 * c.hidden_size * c.intermediate_size
    mlps = [dense_mlp] * c.num_layers
    if c.moe is not None:
        routed = 3 * c.hidden_size * c.moe.intermediate_size * (c.moe.experts_per_token + c.moe.num_shared_experts)
        mlps = [routed if i in c.moe_layers else dense_mlp for i in range(c.num_layers)]
    return 2.0 * (c.num_layers * projections + sum(mlps)), float(c.num_layers * per_key)


@dataclasses.dataclass
class PrefillStats:
    """Prompt tokens the engine's prefills had, and how many they computed (the others were
    shared with an equal prompt of the batch or found in the prefix store), in tokens and in
    FLOPs (positions late in a prompt attend to more keys: a saved early token saves less)."""

    config: Any = None  # the model, for FLOPs (token_flops)
    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    prompt_flops: float = 0.0
    prefilled_flops: float = 0.0

    def add(self, prompts: Sequence[int], prefilled: Sequence[tuple[int, int]]) -> None:
        """prompts: every row's prompt length; prefilled: the positions [start, end) each
        computed row prefilled."""
        fixed, per_key = token_flops(self.config) if self.config is not None else (1.0, 0.0)
        flops = lambda a, b: (b - a) * fixed + per_key * (b * (b + 1) - a * (a + 1)) / 2  # noqa: E731  (keys: t + 1)
        self.prompt_tokens += sum(prompts)
        self.prefilled_tokens += sum(b - a for a, b in prefilled)
        self.prompt_flops += sum(flops(0, n) for n in prompts)
        self.prefilled_flops += sum(flops(a, b) for a, b in prefilled)

    def take(self) -> dict[str, float]:
        saved = lambda done, total: 1.0 - done / total if total else 0.0  # noqa: E731
        out = {"prefill_saved_frac": saved(self.prefilled_tokens, self.prompt_tokens),
               "prefill_flops_saved_frac": saved(self.prefilled_flops, self.prompt_flops)}
        self.prompt_tokens = self.prefilled_tokens = 0
        self.prompt_flops = self.prefilled_flops = 0.0
        return out


class PrefixStore:
    """Sequences' KV by their token ids, least recently used first; at most `capacity` tokens.
    Thread-safe: the engine generates in a worker thread while episodes end on its event loop."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"the prefix cache's capacity must be >= 0 tokens, got {capacity}")
        self.capacity = capacity
        self._entries: collections.OrderedDict[tuple[int, ...], Prefix] = collections.OrderedDict()
        self._lengths: collections.Counter[int] = collections.Counter()
        self._refs: collections.Counter[tuple[int, ...]] = collections.Counter()  # requests that stored it
        self.tokens = 0
        self.stats = PrefixStats()
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: Sequence[int]) -> Prefix | None:
        """The longest stored sequence that is a proper prefix of `prompt` (at least one token is
        left to prefill), counted in the hit statistics; None if there is none."""
        prompt = tuple(prompt)
        with self._lock:
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
        """Keep `entry` (the most recently used), stored once more; `extends`, the entry its
        request grew from, is released once (dropped when no request that stored it is left to
        extend it); the least recently used go while over capacity."""
        with self._lock:
            if extends is not None:
                self.release(extends.ids)
            if len(entry) > self.capacity:
                return
            self._refs[entry.ids] += 1
            if entry.ids in self._entries:  # the same sequence again (another request with the same past)
                self._entries.move_to_end(entry.ids)
                return
            self._entries[entry.ids] = entry
            self._lengths[len(entry)] += 1
            self.tokens += len(entry)
            while self.tokens > self.capacity:
                self._drop(next(iter(self._entries)))
                self.stats.evictions += 1

    def release(self, ids: Sequence[int]) -> None:
        """A request that stored `ids` will not extend it (its episode ended, or its next request
        was stored): stored once less, dropped when no request is left to extend it."""
        ids = tuple(ids)
        with self._lock:
            self._refs[ids] -= 1
            if self._refs[ids] <= 0:
                self._drop(ids)

    def _drop(self, ids: tuple[int, ...]) -> None:
        self._refs.pop(ids, None)
        entry = self._entries.pop(ids, None)
        if entry is not None:
            self.tokens -= len(entry)
            self._lengths[len(entry)] -= 1
            if not self._lengths[len(entry)]:
                del self._lengths[len(entry)]

    def clear(self) -> None:
        """Forget every entry (new weights: their KV would be of the old ones)."""
        with self._lock:
            self._entries.clear()
            self._lengths.clear()
            self._refs.clear()
            self.tokens = 0


@flax.struct.dataclass
class Prefixes:
    """What precedes each row's prefill window, as the prefill's cache receives it: stored KV
    [layers, rows, C, ...] (C = the columns before the window), how many of them each row fills,
    where they start, and the number of cache slots before the window."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None
    v_scale: jax.Array | None
    counts: jax.Array  # [rows]
    starts: jax.Array  # [rows]
    length: jax.Array  # scalar


def cache_with_prefixes(config: Any, slots: int, dtype: str, prefixes: Prefixes) -> KVCache:
    """An empty cache of one row per prompt × `slots`, row r holding its stored prefix (its first
    counts[r] columns of prefixes.k / v, and scales) at slots starts[r].., its length the window's
    start. Traced inside the prefill's jit."""
    k = prefixes.k
    U, C = k.shape[1], k.shape[2]
    cache = KVCache.empty(config, U, slots, dtype)
    rows = jnp.arange(U)[:, None]
    cols = jnp.where(jnp.arange(C)[None] < prefixes.counts[:, None], prefixes.starts[:, None] + jnp.arange(C)[None],
                     slots)
    put = lambda big, new: None if big is None else big.at[:, rows, cols].set(new.astype(big.dtype), mode="drop")  # noqa: E731
    return cache.replace(k=put(cache.k, k), v=put(cache.v, prefixes.v), k_scale=put(cache.k_scale, prefixes.k_scale),
                         v_scale=put(cache.v_scale, prefixes.v_scale),
                         valid=cache.valid.at[rows, cols].set(True, mode="drop"), length=prefixes.length)



@dataclasses.dataclass(frozen=True)
class PrefillWindow:
    """How rows of left-padded prompts [rows, width] are prefilled: only their last `width`
    columns (`tokens`, `mask`, `positions`: [rows, width]); what comes before is `before`."""

    tokens: np.ndarray
    mask: np.ndarray
    positions: np.ndarray
    before: Prefixes

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def arrays(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return jnp.asarray(self.tokens), jnp.asarray(self.mask), jnp.asarray(self.positions)

    def prompt_routing(self, window_routing: dict[str, np.ndarray], prefix: Prefix | None,
                       length: int) -> dict[str, np.ndarray]:
        """A prompt's recorded choices per token (`sampling.choices`; each [length, ...]): the
        stored prefix's before the window, the window's (this row's, [width, ...]) after."""
        S = self.width
        return {name: np.concatenate([*([] if length <= S else [prefix.routing[name][:length - S]]),
                                      np.asarray(part)[max(0, S - length):]])
                for name, part in window_routing.items()}


def prefill_window(config: Any, dtype: str, prompts: Sequence[Sequence[int]], prefixes: Sequence[Prefix | None],
                   width: int, pad_id: int) -> PrefillWindow:
    """The prefill of `prompts`, left-padded to `width` columns, each extending its stored prefix
    (or None): the window of their last columns that holds every token no prefix covers (a power
    of two, at least 16, at most `width`), and the stored KV of what precedes it, built on the host
    (one transfer; no device op per shape)."""
    suffix = max(len(p) - (len(x) if x is not None else 0) for p, x in zip(prompts, prefixes))
    S = min(width, bucket(suffix, 16))
    rows = len(prompts)
    tokens = np.full((rows, width), pad_id, np.int32)
    mask = np.zeros((rows, width), bool)
    for u, prompt in enumerate(prompts):
        tokens[u, width - len(prompt):] = prompt
        mask[u, width - len(prompt):] = True
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    placed = [max(0, len(p) - S) if x is not None else 0 for p, x in zip(prompts, prefixes)]
    before = width - S
    fp8 = np.dtype(jnp.dtype(dtype)).itemsize == 1

    def stacked(field: str) -> np.ndarray:
        heads, width = config.cache_entries[field[0] == "v"]
        trail = (heads, width) if field in ("k", "v") else (heads,)
        out = np.zeros((config.num_layers, rows, before, *trail), np.float32)
        for u, (x, n) in enumerate(zip(prefixes, placed)):
            if x is not None and n:
                out[:, u, :n] = getattr(x, field)[:, :n]
        return out
    stored = Prefixes(k=stacked("k"), v=stacked("v"), k_scale=stacked("k_scale") if fp8 else None,
                      v_scale=stacked("v_scale") if fp8 else None, counts=np.asarray(placed, np.int32),
                      starts=np.asarray([width - len(p) for p in prompts], np.int32), length=np.int32(before))
    return PrefillWindow(tokens=tokens[:, before:], mask=mask[:, before:], positions=positions[:, before:],
                         before=stored)
