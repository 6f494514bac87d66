"""User code named in a config by import path ('package.module:attribute'): reward functions,
environments."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def import_callable(path: str, what: str, form: str = "module:function") -> Callable[..., Any]:
    """The callable `path` names; ValueError saying which part is wrong, `what` naming it
    ("reward function", "environment")."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {path!r} must be given as '{form}'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {path!r}: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{what} {path!r}: {module_name!r} has no callable {attr!r}")
    return fn
