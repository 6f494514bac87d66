"""User code named in a config by import path ('package.module:attribute'): reward functions,
environments."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any


def _import(module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        here = os.getcwd()
        if e.name != module_name.split(".")[0] or here in sys.path:
            raise
        sys.path.append(here)  # last: an installed package of the same name still wins
        return importlib.import_module(module_name)


def import_callable(path: str, what: str, form: str = "module:function") -> Callable[..., Any]:
    """The callable `path` names; ValueError saying which part is wrong, `what` naming it
    ("reward function", "environment"). A module is looked for where Python looks, then in the
    working directory (as `python -m` would; the `opd-jax` command's own path does not hold it)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {path!r} must be given as '{form}'")
    try:
        module = _import(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {path!r}: cannot import {module_name!r} ({e}; looked in the installed packages "
                         f"and in the working directory {os.getcwd()})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{what} {path!r}: {module_name!r} has no callable {attr!r}")
    return fn
