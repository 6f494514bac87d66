"""Llama / Qwen2 / Qwen3 decoders in Flax NNX, a critic built on the same backbone, and their I/O."""

from opd_jax.models.config import ModelConfig, ModelFormatError, RopeScaling
from opd_jax.models.decoder import Backbone, Decoder, KVCache
from opd_jax.models.io import export_model, load_model, save_model
from opd_jax.models.pretrained import resolve_model_path, smollm2_gguf
from opd_jax.models.tokenizer import Tokenizer
from opd_jax.models.value import ValueModel

__all__ = ["Backbone", "Decoder", "KVCache", "ModelConfig", "ModelFormatError", "RopeScaling", "Tokenizer",
           "ValueModel", "export_model", "load_model", "resolve_model_path", "save_model", "smollm2_gguf"]
