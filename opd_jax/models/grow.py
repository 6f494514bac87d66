"""A larger model that starts as exactly the smaller one (function-preserving growth), for a merge
student with more capacity than the experts it learns from.

Deeper (`num_layers`), Net2DeeperNet-style: layer i of the base becomes a run of layers, the first
the original and each added one a copy of it with its output projections (attention's o, o's
bias, the MLP's down) zeroed, so it adds nothing to the residual stream at the start; its
attention and MLP inputs are trained ones, so it gets a useful gradient from the first step. New
layers are spread evenly: grown layer k copies base layer ⌊k·L/L'⌋.

Wider MLP (`intermediate_size`), Net2WiderNet: each added unit copies a base unit j (gate and up
columns; chosen in turn, j = 0, 1, ...), and unit j's down row is split equally among its c_j
copies (itself included), so Σ over the copies of act · down/c_j is the base's act · down.
`noise` (× each weight matrix's std) is added to the copies' gate and up columns to break their
symmetry: 0 keeps the function exact.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from opd_jax.models.decoder import Decoder

_OUTPUTS = ("o", "o_bias", "down")  # a layer's writes into the residual stream


def grow(model: Decoder, *, num_layers: int | None = None, intermediate_size: int | None = None,
         noise: float = 0.0, seed: int = 0) -> Decoder:
    """The model grown to num_layers layers and an MLP of intermediate_size units (None: as it
    is), computing the same function when noise is 0 (see the module docstring). Dense models only."""
    config = model.config
    if config.moe is not None:
        raise ValueError("growing a mixture-of-experts student is not supported: grow a dense one, or train a "
                         "larger MoE from its config")
    layers, width = num_layers or config.num_layers, intermediate_size or config.intermediate_size
    if layers < config.num_layers or width < config.intermediate_size:
        raise ValueError(f"a grown model cannot be smaller than its base: {layers} layers × {width} MLP units from "
                         f"{config.num_layers} × {config.intermediate_size}")
    if noise < 0:
        raise ValueError(f"noise must be >= 0, got {noise}")
    grown_config = dataclasses.replace(config, num_layers=layers, intermediate_size=width)
    dtype = model.param_dtype
    grown = Decoder(grown_config, param_dtype=dtype, compute_dtype=model.backbone.compute_dtype, rngs=nnx.Rngs(seed))
    old = {k: np.asarray(v, np.float32) for k, v in model.backbone.layers.arrays().items()}
    source = [k * config.num_layers // layers for k in range(layers)]
    added = np.array([k > 0 and source[k] == source[k - 1] for k in range(layers)])
    new = {}
    for name, value in old.items():
        value = value[source]
        if name in _OUTPUTS:
            value[added] = 0.0
        new[name] = value
    if width > config.intermediate_size:
        rng = np.random.default_rng(seed)
        units = np.concatenate([np.arange(config.intermediate_size),
                                np.arange(width - config.intermediate_size) % config.intermediate_size])
        copies = np.bincount(units, minlength=config.intermediate_size)
        for name in ("gate", "up"):
            widened = new[name][..., units]
            if noise:
                extra = widened[..., config.intermediate_size:]
                extra += noise * new[name].std() * rng.standard_normal(extra.shape).astype(np.float32)
            new[name] = widened
        new["down"] = new["down"][:, units, :] / copies[units][None, :, None]
    for name, value in new.items():
        getattr(grown.backbone.layers, name)[...] = jnp.asarray(value, dtype)
    grown.backbone.embed[...] = model.backbone.embed[...]
    grown.backbone.final_norm[...] = model.backbone.final_norm[...]
    if not config.tie_word_embeddings:
        grown.lm_head[...] = model.lm_head[...]
    return grown
