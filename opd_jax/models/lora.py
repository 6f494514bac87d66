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
down_proj ("all-linear": all seven). An MLP name covers every MLP of that name, as PEFT's
suffix matching does: the dense MLP, a MoE model's shared experts and each routed expert (one
adapter per expert). The router and the output head stay frozen.
"""

from __future__ import annotations

import dataclasses
import string
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# PEFT's module name -> the stacked weights it adapts (LayerStack attribute names)
MODULES: dict[str, tuple[str, ...]] = {
    "q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",),
    "gate_proj": ("gate", "shared_gate", "expert_gate"),
    "up_proj": ("up", "shared_up", "expert_up"),
    "down_proj": ("down", "shared_down", "expert_down"),
}
ALL_LINEAR = "all-linear"
RANK_AXIS = "lora_rank"
SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """rank r, alpha α (the update is scaled by α/r) and the PEFT module names adapted."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = tuple(MODULES)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
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


def project(spec: str, x: jax.Array, w: dict[str, jax.Array], name: str, scale: float) -> jax.Array:
    """einsum(spec, x, w[name]) plus, where w holds the weight's adapter, scale·(x·A)·B, taken on
    the activations (two thin matmuls: the backward never forms a weight-sized gradient)."""
    y = jnp.einsum(spec, x, w[name])
    if name + SUFFIX_A not in w:
        return y
    ins, out = spec.split("->")
    lhs, rhs = ins.split(",")
    r = next(c for c in string.ascii_letters if c not in spec)
    contracted = "".join(c for c in rhs if c in lhs)
    rest = "".join(c for c in lhs if c not in contracted)
    low = jnp.einsum(f"{lhs},{contracted}{r}->{rest}{r}", x, w[name + SUFFIX_A])
    kept = "".join(c for c in rhs if c not in lhs)
    return y + scale * jnp.einsum(f"{rest}{r},{r}{kept}->{out}", low, w[name + SUFFIX_B])


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
