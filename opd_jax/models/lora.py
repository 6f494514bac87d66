"""LoRA (Hu et al., 2021): a low-rank update W + (α/r)·A·B on the decoder's projections, A
[in, r] and B [r, out] held as Flax NNX `LoRAParam`s beside the frozen base.

The decoder keeps every layer's weights stacked and runs one `lax.scan` over them, so the
adapters are stacked the same way (A: [layers, in..., r], B: [layers, r, out...]; a routed
expert's with the expert axis after the layers) and travel through the scan beside their base
weight as `{name}_lora_a` / `{name}_lora_b`. qwix's `LoraProvider` cannot serve here: it finds
the weight an einsum reads by identity with a module parameter, and inside the scan the decoder
reads per-layer slices of the stacked arrays. Flax supplies the adapter's variable type (which
the training steps' filters use) and the initializers; the one matmul on each side is below.

Targets use PEFT's module names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
down_proj, and GLM-5's q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj ("all-linear": every
one the model has). An MLP name covers every MLP of that name, as PEFT's
suffix matching does: the dense MLP, a MoE model's shared experts and each routed expert (one
adapter per expert). The router and the output head stay frozen.

A forward pass runs the adapters as `Adapting` says: their scale, a bank's adapter per row
(`bank`: many LoRA models on one base in one call) and, in training, dropout on their inputs.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import nnx

# PEFT's module name -> the stacked weights it adapts (LayerStack attribute names)
MODULES: dict[str, tuple[str, ...]] = {
    "q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",),
    "gate_proj": ("gate", "shared_gate", "expert_gate"),
    "up_proj": ("up", "shared_up", "expert_up"),
    "down_proj": ("down", "shared_down", "expert_down"),
    # GLM-5's latent attention (its o_proj is o_proj); DSA's indexer takes no adapter: no gradient reaches it
    "q_a_proj": ("q_a",), "q_b_proj": ("q_b",), "kv_a_proj_with_mqa": ("kv_a",), "kv_b_proj": ("kv_b",),
}
ALL_LINEAR = "all-linear"
RANK_AXIS = "lora_rank"
BANK_AXIS = "lora_adapter"  # a bank's adapters (`bank`)
SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """rank r, alpha α (the update is scaled by α/r), the PEFT module names adapted, and dropout p
    on the adapters' input in training (PEFT's lora_dropout)."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = tuple(MODULES)
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        unknown = [t for t in self.targets if t not in MODULES]
        if unknown:
            raise ValueError(f"no module {unknown[0]!r} to adapt; the decoder has {', '.join(MODULES)} "
                             f"(or {ALL_LINEAR!r})")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def adapts(self, weight: str) -> bool:
        return any(weight in MODULES[t] for t in self.targets)


def _split(weight: str) -> tuple[int, int]:
    """(leading axes, input axes) of a stacked weight: layers (and experts) lead, then the input
    dimensions (o: heads × head_dim), then the output ones."""
    return (2 if weight.startswith("expert_") else 1), (2 if weight == "o" else 1)


def add_adapters(layers: nnx.Module, lora: LoraConfig, rngs: nnx.Rngs) -> None:
    """Give each targeted stacked weight of `layers` (a LayerStack) its A and B (drawn after every
    base weight, so a seed gives the same base with or without adapters): A drawn as PEFT
    draws it (Kaiming-uniform with a = √5: U(±1/√in)), B zero, so the model's function is
    unchanged until B trains."""
    for name, var in list(vars(layers).items()):
        if not (isinstance(var, nnx.Param) and lora.adapts(name)):
            continue
        w, axes = var[...], var.get_metadata()["logical_axes"]
        lead, ins = _split(name)
        fan_in = tuple(range(lead, lead + ins))
        init = jax.nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=fan_in,
                                                    out_axis=-1, batch_axis=tuple(range(lead)))
        a = init(rngs.params(), w.shape[:lead + ins] + (lora.rank,), jnp.float32).astype(w.dtype)
        b = jnp.zeros(w.shape[:lead] + (lora.rank,) + w.shape[lead + ins:], w.dtype)
        setattr(layers, name + SUFFIX_A, nnx.LoRAParam(a, logical_axes=axes[:lead + ins] + (RANK_AXIS,)))
        setattr(layers, name + SUFFIX_B, nnx.LoRAParam(b, logical_axes=axes[:lead] + (RANK_AXIS,) + axes[lead + ins:]))


def is_adapter(name: str) -> bool:
    return name.endswith((SUFFIX_A, SUFFIX_B))


def base_name(name: str) -> str:
    """The weight an adapter belongs to ('q_lora_a' -> 'q'); any other name is its own."""
    return name[:-len(SUFFIX_A)] if is_adapter(name) else name


@dataclasses.dataclass(frozen=True)
class Adapting:
    """How one forward pass runs a model's adapters: the scale α/r; rows, for a bank (`bank`),
    the adapter each row runs with; and in training, dropout p with its key (`at` folds in the
    layer, `project` the weight), so each layer and projection draws its own mask."""

    scale: float = 1.0
    rows: jax.Array | None = None
    dropout: float = 0.0
    key: jax.Array | None = None

    def at(self, layer: jax.Array) -> Adapting:
        return self if self.key is None else dataclasses.replace(self, key=jax.random.fold_in(self.key, layer))


_WEIGHTS = tuple(w for names in MODULES.values() for w in names)  # a weight's index keys its dropout mask


def project(spec: str, x: jax.Array, w: dict[str, jax.Array], name: str, lora: Adapting = Adapting()) -> jax.Array:
    """einsum(spec, x, w[name]) plus, where w holds the weight's adapter, scale·(x̃·A)·B, taken on
    the activations (two thin matmuls: the backward never forms a weight-sized gradient). x̃ is x,
    or in training with dropout p, x·m/(1−p) with m ~ Bernoulli(1−p) per element (PEFT's
    lora_dropout: the base path sees x whole).

    lora.rows: a bank of adapters (A [n, in..., r], B [n, r, out...]: n adapters of one weight)
    and, per row of x (its first axis), the adapter it runs with: row b adds scale·(x_b·A[rows[b]])·
    B[rows[b]] (S-LoRA's batched forward: many adapters on one base in one call)."""
    y = jnp.einsum(spec, x, w[name])
    if name + SUFFIX_A not in w:
        return y
    a, b, scale, rows = w[name + SUFFIX_A], w[name + SUFFIX_B], lora.scale, lora.rows
    if lora.key is not None and lora.dropout > 0:
        keep = jax.random.bernoulli(jax.random.fold_in(lora.key, _WEIGHTS.index(name)), 1.0 - lora.dropout, x.shape)
        x = jnp.where(keep, x / (1.0 - lora.dropout), 0).astype(x.dtype)
    ins, out = spec.split("->")
    lhs, rhs = ins.split(",")
    r = next(c for c in string.ascii_letters if c not in spec)
    contracted = "".join(c for c in rhs if c in lhs)
    rest = "".join(c for c in lhs if c not in contracted)
    kept = "".join(c for c in rhs if c not in lhs)
    row = ""
    if rows is not None:
        chex.assert_shape(rows, x.shape[:1])
        a, b, row = a[rows], b[rows], lhs[0]
    low = jnp.einsum(f"{lhs},{row}{contracted}{r}->{rest}{r}", x, a)
    return y + scale * jnp.einsum(f"{rest}{r},{row}{r}{kept}->{out}", low, b)


def bank(stacks: Sequence[nnx.Module]) -> dict[str, nnx.LoRAParam]:
    """The adapters of several LayerStacks (one base, one LoraConfig) as one bank for `project`'s
    rows: each adapter stacked along a new "lora_adapter" axis after the layers' (A [layers, n,
    in..., r]), so the decoder's scan hands every layer its n adapters. Routed experts' adapters
    cannot be banked (their ragged matmuls take merged weights): ValueError, as for stacks whose
    adapters differ in weights or rank."""
    adapters = [{k: v for k, v in vars(s).items() if isinstance(v, nnx.LoRAParam)} for s in stacks]
    names = sorted(adapters[0])
    for i, one in enumerate(adapters[1:], 1):
        if sorted(one) != names or any(one[k].shape != adapters[0][k].shape for k in names):
            raise ValueError(f"adapter {i} adapts other weights, or at another rank, than adapter 0")
    if any(k.startswith("expert_") for k in names):
        raise ValueError("routed experts' adapters cannot be banked (their matmuls take merged weights)")
    out = {}
    for k in names:
        axes = adapters[0][k].get_metadata()["logical_axes"]
        out[k] = nnx.LoRAParam(jnp.stack([one[k][...] for one in adapters], axis=1),
                               logical_axes=axes[:1] + (BANK_AXIS,) + axes[1:])
    return out


def merged_weight(w: Any, a: jax.Array, b: jax.Array, name: str, scale: float) -> jax.Array:
    """W + scale·A·B for a weight and its adapter, stacked or one layer's slice (any leading axes),
    in the adapter's dtype where W is held quantized (QLoRA's base), else in W's."""
    ins = _split(name)[1]
    lead = a.ndim - 1 - ins
    flat_a = a.reshape(a.shape[:lead] + (-1, a.shape[-1]))
    flat_b = b.reshape(b.shape[:lead + 1] + (-1,))
    delta = jnp.einsum("...ir,...ro->...io", flat_a.astype(jnp.float32), flat_b.astype(jnp.float32))
    base = w.astype(jnp.float32)  # a quantized weight dequantizes here
    return (base + scale * delta.reshape(base.shape)).astype(w.dtype if isinstance(w, jax.Array) else a.dtype)


def merge_adapters(weights: dict[str, Any], scale: float) -> dict[str, Any]:
    """A stacked-weight dict with every adapter folded into its weight and dropped."""
    out = {k: v for k, v in weights.items() if not is_adapter(k)}
    for name in out:
        if name + SUFFIX_A in weights:
            out[name] = merged_weight(out[name], weights[name + SUFFIX_A], weights[name + SUFFIX_B], name, scale)
    return out


def _dequantized(weights: dict[str, Any], dtype: Any) -> dict[str, Any]:
    """Every weight held quantized (a QLoRA base's) as a plain array of `dtype`."""
    return {k: v if isinstance(v, jax.Array) else v.astype(dtype) for k, v in weights.items()}


def dequantized_params(params: dict[str, Any]) -> dict[str, Any]:
    """A pure parameter dict with a quantized base (QLoRA's) dequantized, its adapters kept."""
    layers = _dequantized(params["backbone"]["layers"], params["backbone"]["embed"].dtype)
    return {**params, "backbone": {**params["backbone"], "layers": layers}}


def adapts_routed_experts(config: Any) -> bool:
    """Whether a model config's adapters include routed experts' (whose forward merges them)."""
    return (config.lora is not None and config.moe is not None
            and any(config.lora.adapts(w) for w in ("expert_gate", "expert_up", "expert_down")))


def base_params(config: Any, params: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(config, pure parameter dict) of the frozen base under a model's adapters: the adapters
    dropped, a quantized base dequantized."""
    if config.lora is None:
        return config, params
    dtype = params["backbone"]["embed"].dtype
    layers = _dequantized({k: v for k, v in params["backbone"]["layers"].items() if not is_adapter(k)}, dtype)
    return dataclasses.replace(config, lora=None), {**params, "backbone": {**params["backbone"], "layers": layers}}


def merged_params(config: Any, params: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(config, pure parameter dict) of a model with adapters -> the same function as a plain
    model: each adapter folded into its weight, a quantized base dequantized (what an engine runs
    and an export writes). A model without adapters comes back as it is."""
    if config.lora is None:
        return config, params
    dtype = params["backbone"]["embed"].dtype
    layers = _dequantized(merge_adapters(params["backbone"]["layers"], config.lora.scale), dtype)
    backbone = {**params["backbone"], "layers": layers}
    return dataclasses.replace(config, lora=None), {**params, "backbone": backbone}
