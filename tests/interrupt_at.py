"""`opd-jax ARGS...` (the CLI's main, as a user runs it) interrupted at a chosen moment:

- `save`: Ctrl-C twice in the middle of saving the step-4 checkpoint: the first asks for a stop
  at the step boundary, the second arrives while orbax writes the step's files (after they are
  written, before the step commits);
- `eval`: SIGTERM as the held-out evaluation after step 3 starts;
- `kill`: SIGKILL in the middle of saving the step-4 checkpoint (orbax has written the step's files
  under their temporary name; it has not committed them).

usage: python interrupt_at.py save|eval|kill ARGS...
"""

import os
import signal
import sys

from xla_env import xla_flags  # this script's folder is on sys.path

os.environ["XLA_FLAGS"] = xla_flags(8)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

# as in the suite's own processes (conftest), so that a run here equals one there bit for bit
jax.config.update("jax_default_matmul_precision", "highest")

from save_hooks import during_save  # noqa: E402  (this script's folder is on sys.path)

from opd_jax.cli import main  # noqa: E402
from opd_jax.train.rollouts import RolloutSession  # noqa: E402


def twice_during_the_step_4_save() -> None:
    def twice() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
    during_save(4, twice)


def killed_during_the_step_4_save() -> None:
    during_save(4, lambda: os.kill(os.getpid(), signal.SIGKILL))


def at_the_step_3_evaluation() -> None:
    evaluate = RolloutSession.evaluate

    def evaluate_or_stop(self, at_step, stop=lambda: False):
        if at_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(self, at_step, stop)

    RolloutSession.evaluate = evaluate_or_stop


{"save": twice_during_the_step_4_save, "eval": at_the_step_3_evaluation,
 "kill": killed_during_the_step_4_save}[sys.argv[1]]()
sys.argv = ["opd-jax", *sys.argv[2:]]
main()
