"""A fault injected into orbax's checkpoint save, for the test workers that interrupt or kill a
run mid-save: `during_save(step, act)` calls `act()` once orbax has written step's files under
their temporary name, before it commits them (saved synchronously or not)."""

from collections.abc import Callable

import orbax.checkpoint as ocp


def during_save(step: int, act: Callable[[], None]) -> None:
    handler = ocp.CompositeCheckpointHandler
    write = {name: getattr(handler, name) for name in ("save", "async_save")}

    def maybe_act(directory) -> None:
        if f"{step}.orbax-checkpoint-tmp" in str(directory):
            act()

    async def async_save(self, directory, *args, **kwargs):
        out = await write["async_save"](self, directory, *args, **kwargs)
        maybe_act(directory)
        return out

    def save(self, directory, *args, **kwargs):
        write["save"](self, directory, *args, **kwargs)
        maybe_act(directory)

    handler.save, handler.async_save = save, async_save
