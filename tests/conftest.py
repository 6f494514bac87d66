"""Test set-up: JAX on 8 simulated CPU devices (set before jax is imported), float32 matmuls at
full precision, and the shared model fixtures."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory):
    """The loop tests' tiny run (train_loop_settings: TINY + RESUME_ARGS), uninterrupted: what every
    interrupted and resumed run must equal. Shared, so never write into it."""
    from train_loop_settings import RESUME_ARGS, TINY

    from opd_jax.config import load_config
    from opd_jax.train import train
    return train(load_config(None, [*TINY, *RESUME_ARGS, f"logging.run_dir={tmp_path_factory.mktemp('straight')}"]))
