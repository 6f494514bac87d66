"""`opd-jax ARGS...` (the CLI's main, as a user runs it) interrupted at a chosen moment:

- `save`: Ctrl-C twice in the middle of saving the step-4 checkpoint: the first asks for a stop
  at the step boundary, the second arrives while orbax writes the step's files (after they are
  written, before the step commits);
- `eval`: SIGTERM as the held-out evaluation after step 3 starts.

usage: python interrupt_at.py save|eval ARGS...
"""

import os
import signal
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import orbax.checkpoint as ocp  # noqa: E402

from opd_jax.cli import main  # noqa: E402
from opd_jax.train.rollouts import RolloutSession  # noqa: E402


def twice_during_the_step_4_save() -> None:
    handler = ocp.CompositeCheckpointHandler
    write = {name: getattr(handler, name) for name in ("save", "async_save")}

    def interrupt(directory) -> None:
        if "4.orbax-checkpoint-tmp" in str(directory):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    async def async_save(self, directory, *args, **kwargs):
        out = await write["async_save"](self, directory, *args, **kwargs)
        interrupt(directory)
        return out

    def save(self, directory, *args, **kwargs):
        write["save"](self, directory, *args, **kwargs)
        interrupt(directory)

    handler.save, handler.async_save = save, async_save


def at_the_step_3_evaluation() -> None:
    evaluate = RolloutSession.evaluate

    def evaluate_or_stop(self, at_step, stop=lambda: False):
        if at_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(self, at_step, stop)

    RolloutSession.evaluate = evaluate_or_stop


{"save": twice_during_the_step_4_save, "eval": at_the_step_3_evaluation}[sys.argv[1]]()
sys.argv = ["opd-jax", *sys.argv[2:]]
main()
