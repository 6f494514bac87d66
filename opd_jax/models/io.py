"""`load_model` / `save_model`: Hugging Face directories (config.json + safetensors, sharded or
not) and GGUF files in; Hugging Face directories out, which transformers and SGLang load back."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from opd_jax.models.adapter_io import save_adapter
from opd_jax.models.config import ModelConfig, ModelFormatError
from opd_jax.models.decoder import Decoder
from opd_jax.models.gguf_io import read_gguf, read_gguf_config
from opd_jax.models.lora import base_params, merged_params
from opd_jax.models.tokenizer import Tokenizer
from opd_jax.models.weights import build_from_params, check_hf_tensors, params_from_hf, params_to_hf

_INDEX = "model.safetensors.index.json"
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _dtype(name: Any) -> Any:
    if name is None:
        return None
    key = jnp.dtype(name).name if not isinstance(name, str) else name
    if key not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use one of {', '.join(_DTYPES)}")
    return _DTYPES[key]


def load_model(path: str | os.PathLike, dtype: Any = "float32", compute_dtype: Any = None
               ) -> tuple[Decoder, Tokenizer | None]:
    """Load a Llama / Qwen2 / Qwen3 decoder and its tokenizer.

    path: a Hugging Face directory (config.json + model.safetensors, or a sharded
    model.safetensors.index.json) or a .gguf file (any quantisation; dequantised on load).
    dtype: parameter dtype; compute_dtype: activation dtype (defaults to dtype).
    The tokenizer is None for a directory without tokenizer.json.
    """
    path = Path(path)
    param_dtype = _dtype(dtype)
    if _is_gguf(path):
        config, tensors, tokenizer = read_gguf(path)
        check_hf_tensors(config, {k: v.shape for k, v in tensors.items()}, str(path))
        params = params_from_hf(config, tensors.__getitem__, param_dtype)
    else:
        config = ModelConfig.from_json(path / "config.json")
        params = _read_safetensors(path, config, param_dtype)
        tokenizer = Tokenizer.from_dir(path)
    return build_from_params(Decoder, config, params, compute_dtype=_dtype(compute_dtype)), tokenizer


def read_model_config(path: str | os.PathLike) -> tuple[ModelConfig, Tokenizer | None]:
    """The architecture and tokenizer of what `load_model` loads from `path`, no weight read."""
    path = Path(path)
    if _is_gguf(path):
        return read_gguf_config(path)
    return ModelConfig.from_json(path / "config.json"), Tokenizer.from_dir(path)


def _is_gguf(path: Path) -> bool:
    """Whether `path` is a GGUF file (else a Hugging Face directory); ModelFormatError when neither."""
    if path.is_file() and path.suffix == ".gguf":
        return True
    if path.is_dir():
        return False
    raise ModelFormatError(f"{path}: " + ("no such file or directory" if not path.exists()
                                          else "expected a Hugging Face model directory or a .gguf file"))


def _read_safetensors(directory: Path, config: ModelConfig, dtype: Any) -> dict[str, Any]:
    index = directory / _INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelFormatError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{directory}: no *.safetensors weights found")
    handles, where, shapes = {}, {}, {}
    try:
        for name in files:
            file = directory / name
            if not file.exists():
                raise ModelFormatError(f"{index}: lists {name}, which does not exist")
            try:
                handles[name] = handle = safe_open(str(file), framework="numpy")
            except (SafetensorError, OSError) as e:
                raise ModelFormatError(f"{file}: cannot be read as safetensors ({e})") from None
            for key in handle.keys():
                where[key] = name
                shapes[key] = tuple(handle.get_slice(key).get_shape())
        check_hf_tensors(config, shapes, str(directory))
        return params_from_hf(config, lambda key: handles[where[key]].get_tensor(key), dtype)
    finally:
        handles.clear()


def save_model(model: Decoder, path: str | os.PathLike, tokenizer: Tokenizer | None = None, *,
               max_shard_bytes: int = 4 << 30) -> Path:
    """Write `model` (and `tokenizer`; adapters merged) as a Hugging Face directory: config.json, safetensors
    (sharded with an index past `max_shard_bytes`), generation_config.json, tokenizer files."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # a model with LoRA adapters is written merged (save_adapter writes the adapters alone)
    config, params = merged_params(model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    dtype = jax.tree.leaves(params)[0].dtype
    tensors = params_to_hf(config, params)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    for stale in list(path.glob("*.safetensors")) + [path / _INDEX]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(a.nbytes for a in tensors.values())
        (path / _INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(jnp.dtype(dtype).name), indent=2))
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids) or None}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if tokenizer is not None:
        tokenizer.save(path)
    return path


def export_model(model: Decoder, path: str | os.PathLike, tokenizer: Tokenizer | None = None, *,
                 base_model: str | None = None) -> Path:
    """What a run exports: `model` as a Hugging Face directory (`save_model`; adapters merged) and,
    for a model with LoRA adapters, the adapters alone in PEFT's format in PATH/adapter
    (`base_model`: the base they apply to, as PEFT records it). A base that exists nowhere else
    (built fresh: `base_model` None) is written beside them, to PATH/base, and named as theirs, so
    the adapters can always be loaded."""
    path = save_model(model, path, tokenizer)
    if model.config.lora is not None:
        if base_model is None:
            config, params = base_params(model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
            base = build_from_params(Decoder, config, params)
            base_model = str(save_model(base, path / "base", tokenizer).resolve())
        save_adapter(model, path / "adapter", base_model=base_model)
    return path
