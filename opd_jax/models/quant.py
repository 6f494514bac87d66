"""Weight-only quantization of a rollout engine's decoder: FP8 (e4m3), INT8 and INT4, in the
layouts serving engines use, the numerics from Google's `qwix` (symmetric absmax scales).

Every matmul weight of the layer stack (attention q/k/v/o, the dense MLP, routed and shared
experts) is viewed as a 2-D [in, out] matrix per layer (and per expert), the view a kernel
multiplies, and quantized on it:

    fp8  channel: one scale per output column;          s = max_in |w| / 448
    fp8  block:   one scale per b × b block (DeepSeek/SGLang FP8 block quantization)
    int8 channel: one scale per output column;          s = max_in |w| / 127.5
    int4 group:   one scale per b input rows × column;  s = max_group |w| / 7.5

    q = round(w / s) (saturated to the type's range; fp8 rounds to nearest even), w ≈ q · s

(qwix extends the integer bound by half a step, so the largest |w| lands on the edge of the top
bucket.) Embeddings, the LM head, norms and routers keep the engine's dtype, as FP8 checkpoints
keep them. The quantized values stay quantized in the engine's parameters; each layer's are
dequantized inside the forward pass, just before its matmuls (a CPU has no low-precision
matmul; an accelerator kernel would take the same layout). Quantization is deterministic."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import flax.struct
import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from opd_jax.models.config import ModelConfig, ModelFormatError

Kind = Literal["fp8", "int8", "int4"]
Scales = Literal["channel", "block", "group"]
QTYPES = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8, "int4": jnp.int4}
SCALES: dict[str, tuple[str, ...]] = {"fp8": ("channel", "block"), "int8": ("channel",), "int4": ("group",)}

# matmul weights of the layer stack: (leading axes: layers, experts), input axes, output axes,
# as positions in the stacked parameter
_MATMULS: dict[str, tuple[int, tuple[int, ...], tuple[int, ...]]] = {
    "q": (1, (1,), (2, 3)), "k": (1, (1,), (2, 3)), "v": (1, (1,), (2, 3)), "o": (1, (1, 2), (3,)),
    "gate": (1, (1,), (2,)), "up": (1, (1,), (2,)), "down": (1, (1,), (2,)),
    "shared_gate": (1, (1,), (2,)), "shared_up": (1, (1,), (2,)), "shared_down": (1, (1,), (2,)),
    "expert_gate": (2, (2,), (3,)), "expert_up": (2, (2,), (3,)), "expert_down": (2, (2,), (3,)),
    # GLM-5's latent attention (its indexer keeps the engine's dtype, as routers do)
    "q_a": (1, (1,), (2,)), "q_b": (1, (1,), (2, 3)), "kv_a": (1, (1,), (2,)), "kv_b": (1, (1,), (2, 3)),
}


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    kind: Kind
    scales: Scales
    block: int = 128  # the block side (fp8 block) or group length (int4 group)

    def __post_init__(self) -> None:
        if self.kind not in QTYPES:
            raise ValueError(f"unknown quantization {self.kind!r}; one of {', '.join(QTYPES)}")
        if self.scales not in SCALES[self.kind]:
            raise ValueError(f"{self.kind} quantization takes scales {' or '.join(SCALES[self.kind])}, "
                             f"not {self.scales!r}")
        if self.block <= 0:
            raise ValueError(f"block size must be positive, got {self.block}")

    def __str__(self) -> str:
        return self.kind + ("" if self.scales == "channel" else f" {self.scales} {self.block}")


@flax.struct.dataclass
class QuantizedWeight:
    """A stacked matmul weight held quantized: `q` (a qwix QArray over the [lead..., in, out]
    view); `shape`: one layer's original shape. Reads like the array it stands for where the
    decoder touches its weights: sliced along the layer axis, and `astype` (dequantize)."""

    q: qwix.QArray
    shape: tuple[int, ...] = flax.struct.field(pytree_node=False)
    stacked_ndim: int = flax.struct.field(pytree_node=False, default=0)  # the [layers, ..., in, out] view's

    def astype(self, dtype: Any) -> jax.Array:
        """Dequantized: one layer's weight (a slice), or the stacked weight of every layer."""
        x = qwix.dequantize(self.q)
        shape = (x.shape[0], *self.shape) if x.ndim == self.stacked_ndim else self.shape
        return x.reshape(shape).astype(dtype)

    def __getitem__(self, index: Any) -> QuantizedWeight:
        return QuantizedWeight(jax.tree.map(lambda x: x[index], self.q), self.shape, self.stacked_ndim)

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(x) for x in jax.tree.leaves(self.q))


def _nbytes(x: jax.Array) -> int:
    return math.ceil(x.size * jnp.dtype(x.dtype).itemsize if x.dtype != jnp.int4 else x.size / 2)


def matrix_view(shape: tuple[int, ...], name: str) -> tuple[int, ...]:
    """[lead..., in, out]: how a stacked weight of `shape` is quantized."""
    lead, inputs, outputs = _MATMULS[name]
    return (*shape[:lead], math.prod(shape[i] for i in inputs), math.prod(shape[i] for i in outputs))


def quantize_weight(w: jax.Array, name: str, scheme: QuantScheme) -> QuantizedWeight:
    """The stacked weight `name` (one of the layer stack's matmul weights) quantized per layer
    (and expert) on its [in, out] view."""
    view = matrix_view(w.shape, name)
    lead = len(view) - 2
    channelwise, tiled = tuple(range(lead)), {}
    if scheme.scales == "channel":
        channelwise += (lead + 1,)
    elif scheme.scales == "group":
        channelwise += (lead + 1,)
        tiled = {lead: scheme.block}
    else:
        tiled = {lead: scheme.block, lead + 1: scheme.block}
    for axis, size in tiled.items():
        if view[axis] % size:
            side = "input" if axis == lead else "output"
            raise ModelFormatError(f"quantization block size {scheme.block} does not divide the {side} width "
                                   f"{view[axis]} of weight layers.{name} (shape {tuple(w.shape)})")
    q = qwix.quantize(w.astype(jnp.float32).reshape(view), QTYPES[scheme.kind], channelwise_axes=channelwise,
                      tiled_axes=tiled)
    return QuantizedWeight(q, tuple(w.shape[1:]), len(view))


def check_quantizable(config: ModelConfig, scheme: QuantScheme) -> None:
    """Raises ModelFormatError naming the first weight a block size does not divide, from the
    model's config alone (before anything is built)."""
    abstract = nnx.eval_shape(lambda: _decoder(config))
    for name, value in _stack_params(abstract).items():
        jax.eval_shape(lambda w, n=name: quantize_weight(w, n, scheme), value)


def quantize_decoder(model: Any, scheme: QuantScheme) -> Any:
    """`model` (a Decoder) with every matmul weight of its layer stack quantized, in place."""
    for name, value in _stack_params(model).items():
        getattr(model.backbone.layers, name).set_value(quantize_weight(value, name, scheme))
    return model


def _stack_params(model: Any) -> dict[str, Any]:
    layers = model.backbone.layers
    return {name: getattr(layers, name).get_value() for name in _MATMULS if hasattr(layers, name)}


def _decoder(config: ModelConfig) -> Any:
    from opd_jax.models.decoder import Decoder
    return Decoder(config, rngs=nnx.Rngs(0))
