"""Algorithm parts in files of their own, one algorithm per file, each registering itself with
a registry of `opd_jax.core.registry` when imported. Every module in this package is imported
here, so adding a built-in algorithm is one new file (and its tests): nothing else lists it."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
