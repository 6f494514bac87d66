"""The errors that stop a run (training, experts, merge) with a message saying why."""


from opd_jax.run_files import RunDirError, RunError  # defined where the sweep, which never imports train, reads them

__all__ = ["EvaluationStopped", "Interrupted", "RunDirError", "RunError"]


class Interrupted(RunError):
    """A run stopped by SIGINT or SIGTERM at a step boundary; the message says what was saved and
    how to continue."""

    prefix = "stopped"

    def __init__(self, message: str, exit_status: int, *, at_once: bool = False):
        super().__init__(message)
        self.exit_status = exit_status
        self.at_once = at_once  # a second Ctrl-C: the process ends without waiting for its threads


class EvaluationStopped(Exception):
    """A held-out evaluation left unfinished because the run was asked to stop (the run loop's to
    handle; never shown to a user)."""
