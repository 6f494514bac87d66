"""Test set-up: JAX on 8 simulated CPU devices (set before jax is imported), float32 matmuls at
full precision, and the shared model fixtures."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
