"""`opd-jax train ARGS...` (the CLI's main, as a user runs it) that gets Ctrl-C twice in the middle
of saving the step-4 checkpoint: the first asks for a stop at the step boundary, the second
arrives while orbax is writing the step's files (after they are written, before the step commits).

usage: python interrupt_during_save.py ARGS...
"""

import os
import signal
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import orbax.checkpoint as ocp  # noqa: E402

from opd_jax.cli import main  # noqa: E402

handler = ocp.CompositeCheckpointHandler
write = {name: getattr(handler, name) for name in ("save", "async_save")}


def interrupted(name):
    async def async_save(self, directory, *args, **kwargs):
        out = await write[name](self, directory, *args, **kwargs)
        if "4.orbax-checkpoint-tmp" in str(directory):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return out

    def save(self, directory, *args, **kwargs):
        write[name](self, directory, *args, **kwargs)
        if "4.orbax-checkpoint-tmp" in str(directory):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
    return async_save if name == "async_save" else save


for name in write:
    setattr(handler, name, interrupted(name))
sys.argv = ["opd-jax", *sys.argv[1:]]
main()
