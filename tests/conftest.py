"""Test set-up: JAX on 8 simulated CPU devices (set before jax is imported), float32 matmuls at
full precision, a persistent compilation cache for the processes the tests start, and the
shared model fixtures."""

import os
from pathlib import Path

from xla_env import xla_flags  # tests/ is on sys.path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Many tests train the same tiny models in fresh processes (the CLI, notebooks, workers): the
# cache, inherited by them, spares each its recompiles (a tiny run's 47 s become 18 s). Keys hash
# the program, flags and versions, so a stale entry is never used.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).parents[1] / ".pytest_cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# The test processes themselves neither write nor read that cache; only the processes they start do.
jax.config.update("jax_enable_compilation_cache", False)

import gc  # noqa: E402

import pytest  # noqa: E402

# Every executable XLA compiles on the CPU keeps three memory mappings of its code and data until
# it is dropped, and a pytest-xdist worker compiles thousands: past the kernel's vm.max_map_count
# (65530 by default) the next compile aborts or segfaults the worker, at whatever test it
# reaches, and under --dist loadgroup the session then waits forever (pytest-xdist #1323). The
# compiled code is memory too, beside a notebook or a server the other worker runs, and a worker
# killed for memory leaves no message either. Dropping the compiled functions returns both; tests
# recompile what they need (a module's tests share their shapes, modules seldom do).
_MAPS = Path("/proc/self/maps")
_MAX_MAPS = 12000


def _drop_compiled_code() -> None:
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _bounded_compiled_code():
    yield
    if _MAPS.exists() and sum(1 for _ in _MAPS.open()) > _MAX_MAPS:
        _drop_compiled_code()


@pytest.fixture(autouse=True, scope="module")
def _compiled_code_of_one_module():
    yield
    _drop_compiled_code()


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory):
    """The loop tests' tiny run (train_loop_settings: TINY + RESUME_ARGS), uninterrupted: what every
    interrupted and resumed run must equal. Shared, so never write into it."""
    from train_loop_settings import RESUME_ARGS, TINY

    from opd_jax.config import load_config
    from opd_jax.train import train
    return train(load_config(None, [*TINY, *RESUME_ARGS, f"logging.run_dir={tmp_path_factory.mktemp('straight')}"]))


def pytest_collection_modifyitems(items):
    """Under pytest-xdist (`-n 2 --dist loadgroup`, the README's command) a test that uses a
    module- or session-scoped fixture runs on the same worker as the rest of its file, so the
    fixture (a loaded model, a launched server) is built once; other tests spread freely. Files
    sharing a session fixture name one group themselves (xdist_group("straight_run"))."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d[-1].scope in ("module", "session", "package", "class") for d in defs if d):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
