"""LoRA adapters in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained(transformers_model, path)` loads onto the Hugging Face base
(and `load_adapter` loads back onto a decoder).

PEFT keeps each adapted `nn.Linear`'s A as `lora_A.weight` [r, in] and B as `lora_B.weight`
[out, r] under `base_model.model.<module path>`; the decoder keeps A [in..., r] and B
[r, out...] stacked over layers, in the Hugging Face weight's own input and output order
(`weights._LAYER_WEIGHTS`), so a layer's tensors are transposes of its slices.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from opd_jax.models.config import ModelFormatError
from opd_jax.models.decoder import Decoder
from opd_jax.models.lora import MODULES, SUFFIX_A, SUFFIX_B, LoraConfig
from opd_jax.models.weights import _LAYER_WEIGHTS

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."


def _entries(model: Decoder) -> list[tuple[str, str, int, int]]:
    """(our adapter name without suffix, PEFT module path, stacked index, layer) per adapted module."""
    layers = model.backbone.layers
    out = []
    for name in sorted(vars(layers)):
        if not name.endswith(SUFFIX_A):
            continue
        weight = name[:-len(SUFFIX_A)]
        if _LAYER_WEIGHTS[weight].per_expert:
            raise ModelFormatError("adapters on routed experts have no PEFT layout (transformers fuses a MoE "
                                   "layer's experts into one parameter); export the merged model instead")
        spec = _LAYER_WEIGHTS[weight]
        module = spec.hf_suffix.removesuffix(".weight")
        out += [(weight, f"model.layers.{i}.{module}", j, i) for j, i in enumerate(spec.layer_ids(model.config))]
    return out


def save_adapter(model: Decoder, path: str | os.PathLike, *, base_model: str | None = None) -> Path:
    """Write `model`'s adapters in PEFT's format into directory `path` (created); `base_model`:
    the base's name or path, recorded as PEFT records it."""
    lora = model.config.lora
    if lora is None:
        raise ValueError("the model has no LoRA adapters to save")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    arrays = {k: np.asarray(v[...]) for k, v in vars(model.backbone.layers).items() if isinstance(v, nnx.LoRAParam)}
    tensors = {}
    for weight, module, j, _ in _entries(model):
        a, b = arrays[weight + SUFFIX_A][j], arrays[weight + SUFFIX_B][j]
        tensors[f"{_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, lora.rank).T)
        tensors[f"{_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b.reshape(lora.rank, -1).T)
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
              "target_modules": list(lora.targets), "lora_dropout": lora.dropout, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
              "modules_to_save": None, "base_model_name_or_path": base_model}
    (path / CONFIG).write_text(json.dumps(config, indent=2))
    return path


def read_adapter_config(path: str | os.PathLike) -> LoraConfig:
    """The LoraConfig of a PEFT adapter directory; ModelFormatError naming what it cannot honour."""
    file = Path(path) / CONFIG
    try:
        raw: dict[str, Any] = json.loads(file.read_text())
    except FileNotFoundError:
        raise ModelFormatError(f"{path}: no {CONFIG} (not a PEFT adapter directory)") from None
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{file}: not valid JSON ({e})") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise ModelFormatError(f"{file}: peft_type {raw.get('peft_type')!r}; only LORA adapters are supported")
    for key, plain in (("use_dora", False), ("use_rslora", False), ("bias", "none"), ("fan_in_fan_out", False)):
        if raw.get(key, plain) != plain:
            raise ModelFormatError(f"{file}: {key}={raw[key]!r} is not supported (only {key}={plain!r})")
    if raw.get("rank_pattern") or raw.get("alpha_pattern"):
        raise ModelFormatError(f"{file}: per-module rank_pattern/alpha_pattern is not supported")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        targets = list(MODULES) if targets == "all-linear" else [targets]
    names = sorted({t.rsplit(".", 1)[-1] for t in targets or []})
    try:
        return LoraConfig(rank=int(raw["r"]), alpha=float(raw["lora_alpha"]), targets=tuple(names),
                          dropout=float(raw.get("lora_dropout") or 0.0))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFormatError(f"{file}: {e}") from None


def load_adapter(model: Decoder, path: str | os.PathLike, *, rngs: nnx.Rngs | None = None) -> Decoder:
    """`model` (without adapters) with the PEFT adapter in directory `path` added in place; a
    module the adapter lacks keeps a zero B (its base weight). ModelFormatError naming a tensor
    that is missing, unexpected or mis-shaped."""
    lora = read_adapter_config(path)
    model.add_lora(lora, rngs or nnx.Rngs(0))
    file = Path(path) / WEIGHTS
    try:
        tensors = load_file(str(file))
    except (FileNotFoundError, SafetensorError, OSError) as e:
        raise ModelFormatError(f"{file}: cannot be read as safetensors ({e})") from None
    tensors = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
               for k, v in tensors.items()}
    layers = model.backbone.layers
    used = set()
    for weight, module, j, _ in _entries(model):
        for suffix, side in ((SUFFIX_A, "lora_A"), (SUFFIX_B, "lora_B")):
            key = f"{_PREFIX}{module}.{side}.weight"
            var = getattr(layers, weight + suffix)
            want = var[...].shape[1:]
            if key not in tensors:
                if side == "lora_A":
                    continue  # a module the adapter does not cover: its B stays zero
                if f"{_PREFIX}{module}.lora_A.weight" in tensors:
                    raise ModelFormatError(f"{file}: {key!r} is missing")
                continue
            t = tensors[key].T  # [in, r] or [r, out]
            expected = (int(np.prod(want[:-1])), want[-1]) if side == "lora_A" else (want[0], int(np.prod(want[1:])))
            if t.shape != expected:
                raise ModelFormatError(f"{file}: {key!r} has shape {tensors[key].shape}, the model needs "
                                       f"{expected[::-1]}")
            var[...] = var[...].at[j].set(jnp.asarray(t.reshape(want), var[...].dtype))
            used.add(key)
    unused = sorted(set(tensors) - used)
    if unused:
        raise ModelFormatError(f"{file}: tensor {unused[0]!r} ({len(unused)} in all) matches no module of this "
                               f"{model.config.num_layers}-layer {model.config.architecture}")
    return model
