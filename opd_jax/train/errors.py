"""The errors that stop a run (training, experts, merge) with a message saying why."""


from opd_jax.errors import OpdJaxError


class RunError(OpdJaxError, RuntimeError):
    """A run that must stop; the message says why."""


class RunDirError(RunError):
    """A run directory that this command may not use (in use, another command's, finished, ...)."""


class Interrupted(RunError):
    """A run stopped by SIGINT or SIGTERM at a step boundary; the message says what was saved and
    how to continue."""

    prefix = "stopped"

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status
