"""The one root of every error the project raises on purpose.

An `OpdJaxError` is a problem the user can fix (a bad config or override, a missing model, a mesh
that does not fit the devices, bad data, incompatible teachers, an engine that will not start,
a run directory in use, ...); its message names the culprit. The CLI prints it as `error: ...`
and exits with status 2, without a traceback (`opd-jax --debug ...` shows one). Any other
exception is a bug and keeps its traceback.

This module imports nothing, so every package can derive from it: `rollout_bridge`, which
otherwise imports nothing from opd_jax, included. Each subclass also derives from the builtin
it stands for (ValueError for bad input, RuntimeError for a run that cannot go on).
"""


class OpdJaxError(Exception):
    """A problem the user can fix; the message says what and where."""
