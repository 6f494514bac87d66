"""The embedded JAX rollout engine: batched prefill + decode over a KV cache, in one jitted call.

Prompts are left-padded to a length bucket so every row's next token sits in the same cache
slot; positions count real tokens only, so a padded row computes exactly what it would alone.
Generation is a `lax.while_loop` that stops once every row has finished, compiled once per
(batch, prompt bucket, max_new_tokens, stop-list width) and reused across calls and weight updates.
Each row draws from its own key, fold_in(fold_in(key, row), step), so a request's sample does not
depend on the rest of the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opd_jax.errors import OpdJaxError
from opd_jax.models.decoder import Decoder, KVCache
from opd_jax.sampling.continuous import DecodeSlots, Result, generate_continuous
from opd_jax.sampling.ops import sample_tokens
from rollout_bridge.records import Rollout, SamplingParams


class PromptTooLongError(OpdJaxError, ValueError):
    """A prompt that does not fit the engine's KV cache together with its max_new_tokens."""


def _bucket(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new", "kv_dtype"))
def _generate(graphdef: nnx.GraphDef, state: nnx.State, prompt: jax.Array, prompt_mask: jax.Array,
              row_keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
              stop_ids: jax.Array, row_max_new: jax.Array, pad_id: jax.Array, *, max_new: int,
              kv_dtype: str | None = None):
    model: Decoder = nnx.merge(graphdef, state)
    B, P = prompt.shape
    cache = KVCache.empty(model.config, B, P + max_new, kv_dtype or model.backbone.compute_dtype)
    positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0).astype(jnp.int32)
    logits, cache, prompt_routing = model.decode(prompt, cache, positions=positions, attention_mask=prompt_mask)
    # MoE: the experts every prompt and output token was routed to (routing replay); -1 = none
    moe = model.config.moe
    routing = None if moe is None else jnp.full((B, max_new, len(model.config.moe_layers), moe.experts_per_token),
                                                -1, jnp.int32)

    def cond(carry):
        step, done = carry[0], carry[3]
        return (step < max_new) & ~jnp.all(done)

    def body(carry):
        step, logits, cache, done, next_pos, tokens, logprobs, lengths, stopped, routing = carry
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, step)
        token, logprob = sample_tokens(logits, keys, temperature, top_k, top_p)
        token = jnp.where(done, pad_id, token)
        tokens = tokens.at[:, step].set(token)
        logprobs = logprobs.at[:, step].set(jnp.where(done, 0.0, logprob))
        lengths = jnp.where(done, lengths, step + 1)
        hit_stop = ~done & jnp.any(token[:, None] == stop_ids, axis=1)
        stopped = stopped | hit_stop
        live = ~done
        done = done | hit_stop | (step + 1 >= row_max_new)
        logits, cache, used = model.decode(token[:, None], cache, positions=next_pos[:, None],
                                           attention_mask=live[:, None])
        if routing is not None:
            routing = routing.at[:, step].set(jnp.where(live[:, None, None], used[:, 0], -1))
        return step + 1, logits, cache, done, next_pos + 1, tokens, logprobs, lengths, stopped, routing

    zeros_b = jnp.zeros((B,), jnp.int32)
    carry = (jnp.zeros((), jnp.int32), logits, cache, jnp.zeros((B,), bool), positions[:, -1] + 1,
             jnp.full((B, max_new), pad_id, jnp.int32), jnp.zeros((B, max_new), jnp.float32), zeros_b,
             jnp.zeros((B,), bool), routing)
    carry = jax.lax.while_loop(cond, body, carry)
    return carry[5], carry[6], carry[7], carry[8], (None if routing is None else (prompt_routing, carry[9]))


class Sampler:
    """Generate from a Decoder: token ids in, `Rollout` records (ids, logprobs, finish reason) out.

    max_cache_len bounds prompt + max_new_tokens (default: the model's max_position_embeddings).
    kv_cache_dtype: the KV cache's precision (default: the model's compute dtype; float8_e4m3fn
    with a scale per token and head). slots: decode at most this many requests at once, by
    continuous batching (`sampling.continuous`: a finished request's slot goes to the next one);
    None: every request of a call in one static batch. `update_weights` swaps in new parameters
    of the same shapes without recompiling.
    """

    def __init__(self, model: Decoder, *, max_cache_len: int | None = None, pad_id: int = 0,
                 weight_version: int = 0, kv_cache_dtype: str | None = None, slots: int | None = None):
        if slots is not None and slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.kv_cache_dtype, self.slots = kv_cache_dtype, slots
        self.graphdef, self.state = nnx.split(model)
        self.config = model.config
        self.max_cache_len = max_cache_len or model.config.max_position_embeddings
        self.pad_id = pad_id
        self.weight_version = weight_version

    def update_weights(self, model: Decoder, weight_version: int) -> None:
        graphdef, state = nnx.split(model)
        if graphdef != self.graphdef:
            raise ValueError("update_weights needs a model of the same architecture and dtypes")
        self.state, self.weight_version = state, weight_version

    def check(self, prompt: Sequence[int], params: SamplingParams, name: str = "the prompt") -> None:
        """ValueError (PromptTooLongError) for a prompt this engine cannot run."""
        if len(prompt) == 0:
            raise ValueError(f"{name} is empty")
        if len(prompt) + params.max_new_tokens > self.max_cache_len:
            raise PromptTooLongError(
                f"{name} has {len(prompt)} tokens; with max_new_tokens={params.max_new_tokens} it needs "
                f"{len(prompt) + params.max_new_tokens} cache slots, but the cache holds {self.max_cache_len}")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"{name} has token id {bad[0]} outside the vocabulary [0, {self.config.vocab_size})")

    def decode_slots(self) -> DecodeSlots:
        """Continuous batching across calls (`sampling.continuous.DecodeSlots`): `slots` decode
        slots of max_cache_len tokens each, with the current weights, for requests that arrive
        while others decode (`open_queue`). Build a new one after `update_weights`."""
        if self.slots is None:
            raise ValueError("decode_slots needs a Sampler built with slots=")
        return DecodeSlots(self.graphdef, self.state, slots=self.slots, cache_len=self.max_cache_len,
                           pad_id=self.pad_id, kv_dtype=self.kv_cache_dtype, open_queue=True)

    def rollout(self, prompt: Sequence[int], result: Result, metadata: dict[str, Any] | None = None) -> Rollout:
        """The Rollout of a continuous-batching result (tokens, log-probs, stopped, experts)."""
        ids, logp, stopped, experts = result
        return Rollout(prompt_ids=tuple(int(t) for t in prompt), output_ids=tuple(int(t) for t in ids),
                       output_logprobs=tuple(float(x) for x in logp), finish_reason="stop" if stopped else "length",
                       weight_version=self.weight_version, metadata=dict(metadata or {}), routed_experts=experts)

    def compiled_variants(self) -> int:
        """How many shapes the generation function has been compiled for (all Samplers)."""
        return _generate._cache_size()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 key: jax.Array, metadata: Sequence[dict[str, Any]] | None = None) -> list[Rollout]:
        """One rollout per prompt, in order. `params` is shared or one per prompt; `key` is one
        PRNG key (row i draws from fold_in(key, i)) or one key per prompt."""
        if not prompts:
            return []
        per_row = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_row) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_row)} SamplingParams")
        max_new = max(p.max_new_tokens for p in per_row)
        longest = max(len(p) for p in prompts)
        for i, (prompt, p) in enumerate(zip(prompts, per_row)):
            self.check(prompt, p, f"prompt {i}")
        width = max(longest, min(_bucket(longest), self.max_cache_len - max_new))
        B = len(prompts)
        tokens = np.full((B, width), self.pad_id, np.int32)
        mask = np.zeros((B, width), bool)
        for i, prompt in enumerate(prompts):
            tokens[i, width - len(prompt):] = prompt
            mask[i, width - len(prompt):] = True
        n_stop = _bucket(max(len(p.stop_token_ids) for p in per_row) or 1, minimum=4)
        stop_ids = np.full((B, n_stop), -1, np.int32)
        for i, p in enumerate(per_row):
            stop_ids[i, :len(p.stop_token_ids)] = p.stop_token_ids
        if key.shape == (B,):
            row_keys = key
        elif key.shape == ():
            row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(B))
        else:
            raise ValueError(f"key must be one PRNG key or one per prompt ({B}), got shape {key.shape}")
        metadata = metadata or [{} for _ in prompts]
        if self.slots is not None and self.slots < B:
            done = generate_continuous(self.graphdef, self.state, prompts, per_row, row_keys, slots=self.slots,
                                       cache_len=width + max_new, pad_id=self.pad_id, kv_dtype=self.kv_cache_dtype)
            return [self.rollout(prompts[i], result, metadata[i]) for i, result in enumerate(done)]
        out_tokens, out_logprobs, lengths, stopped, routing = jax.device_get(_generate(
            self.graphdef, self.state, jnp.asarray(tokens), jnp.asarray(mask), row_keys,
            jnp.asarray([p.temperature for p in per_row], jnp.float32),
            jnp.asarray([p.top_k for p in per_row], jnp.int32),
            jnp.asarray([p.top_p for p in per_row], jnp.float32), jnp.asarray(stop_ids),
            jnp.asarray([p.max_new_tokens for p in per_row], jnp.int32), jnp.int32(self.pad_id),
            max_new=max_new, kv_dtype=self.kv_cache_dtype))

        def routed(i: int) -> np.ndarray | None:
            """[prompt + output tokens, MoE layers, k]: the experts each token went through."""
            if routing is None:
                return None
            prompt_part, output_part = routing
            return np.concatenate([prompt_part[i, width - len(prompts[i]):], output_part[i, :lengths[i]]])

        return [Rollout(prompt_ids=tuple(int(t) for t in prompts[i]),
                        output_ids=tuple(int(t) for t in out_tokens[i, :lengths[i]]),
                        output_logprobs=tuple(float(x) for x in out_logprobs[i, :lengths[i]]),
                        finish_reason="stop" if stopped[i] else "length",
                        weight_version=self.weight_version, metadata=dict(metadata[i]), routed_experts=routed(i))
                for i in range(B)]
