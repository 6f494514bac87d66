"""The error that stops a run (training, experts, merge) with a message saying why."""


from opd_jax.errors import OpdJaxError


class RunError(OpdJaxError, RuntimeError):
    """A run that must stop; the message says why."""
