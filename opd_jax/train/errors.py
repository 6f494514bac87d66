"""The error that stops a run (training, experts, merge) with a message saying why."""


class RunError(RuntimeError):
    """A run that must stop; the message says why."""
