"""Runs the loop test's tiny config and SIGKILLs itself in the middle of saving the step-4
checkpoint (after orbax has started writing it, before the save is confirmed).

usage: python kill_during_save.py RUN_DIR
"""

import os
import signal
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import orbax.checkpoint as ocp  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from train_loop_settings import RESUME_ARGS, TINY  # noqa: E402

from opd_jax.config import load_config  # noqa: E402
from opd_jax.train import train  # noqa: E402

run_dir = Path(sys.argv[1])
finish = ocp.CheckpointManager.wait_until_finished


def wait_or_die(self):
    if any(p.name.startswith("4") for p in (run_dir / "checkpoints").iterdir()):
        os.kill(os.getpid(), signal.SIGKILL)
    return finish(self)


ocp.CheckpointManager.wait_until_finished = wait_or_die
train(load_config(None, [*TINY, f"logging.run_dir={run_dir}", *RESUME_ARGS]))
