"""Runs the loop test's tiny config and SIGKILLs itself in the middle of saving the step-4
checkpoint (orbax has written the step's files under their temporary name; it has not committed them).

usage: python kill_during_save.py RUN_DIR [OVERRIDE ...]   (overrides after the loop test's own)
"""

import os
import signal
import sys
from pathlib import Path

from xla_env import xla_flags  # this script's folder is on sys.path

os.environ["XLA_FLAGS"] = xla_flags(8)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

sys.path.insert(0, os.path.dirname(__file__))
from save_hooks import during_save  # noqa: E402
from train_loop_settings import RESUME_ARGS, TINY  # noqa: E402

from opd_jax.config import load_config  # noqa: E402
from opd_jax.train import train  # noqa: E402

run_dir = Path(sys.argv[1])
during_save(4, lambda: os.kill(os.getpid(), signal.SIGKILL))
train(load_config(None, [*TINY, f"logging.run_dir={run_dir}", *RESUME_ARGS, *sys.argv[2:]]))
