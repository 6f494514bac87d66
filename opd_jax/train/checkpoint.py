"""Checkpoints of a run through orbax: the whole train state (policy, critic, optimizer states,
step) plus the prompt iterator's state and how many prompt groups were drawn.

Faults are the user's to read in one line, never orbax's or tensorstore's: orbax writes each
step under a temporary name and renames it when complete, so a kill mid-save leaves the previous
checkpoint as the latest; a save that fails (a full disk, say) removes its partial directory and
says why; an unreadable checkpoint is moved aside (`checkpoints_unreadable/`, nothing deleted)
and the run falls back to the newest readable one. Orbax's own log lines go to
`checkpoints/orbax.log`, not the terminal.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from opd_jax.train.errors import RunError

_ABSL = logging.getLogger("absl")  # orbax logs through absl


class _LogFile(logging.FileHandler):
    """orbax.log; a write it cannot make (a full disk) is dropped, never printed."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass


def _first_line(error: BaseException, limit: int = 300) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= limit else text[:limit] + " ..."


def _disk_full(error: BaseException) -> bool:
    seen: BaseException | None = error
    while seen is not None:
        if getattr(seen, "errno", None) == errno.ENOSPC or "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Orbax's failed reads leave coroutines whose errors Python prints when they are collected
    ('Exception ignored in ...', tens of lines each); collect them here, silently."""
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        yield
    finally:
        gc.collect()
        sys.unraisablehook = hook


class Checkpoints:
    def __init__(self, directory: Path, keep: int, *, say: Callable[[str], None] = print):
        self.directory = directory.absolute()
        self.say = say
        self.directory.mkdir(parents=True, exist_ok=True)
        self._log = _LogFile(self.directory / "orbax.log")
        _ABSL.addHandler(self._log)
        self._propagate, _ABSL.propagate = _ABSL.propagate, False
        self.manager = self._manager(keep)
        self.keep = keep

    def _manager(self, keep: int) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
                                     item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Write step `step`; a failure removes the partial directory and raises RunError in one line."""
        try:
            with _quiet():
                self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                                meta=ocp.args.JsonSave(meta)))
                self.manager.wait_until_finished()
        except Exception as e:
            removed = self._remove_partial()
            latest = [s for s in self.manager.all_steps(read=True) if s != step]
            kept = (f"the latest complete checkpoint is step {max(latest)}" if latest else
                    "there is no complete checkpoint yet")
            cleaned = "; the partial checkpoint was removed" if removed else ""
            if _disk_full(e):
                free = shutil.disk_usage(self.directory).free / 2**20
                then = "continue with --resume" if latest else "run the same command again"
                raise RunError(f"no space left on device while saving checkpoint step {step} to {self.directory} "
                               f"({free:.1f} MiB free){cleaned}; {kept}. Free some space, then {then}") from None
            raise RunError(f"saving checkpoint step {step} to {self.directory} failed: {_first_line(e)}{cleaned}; "
                           f"{kept}") from None

    def _remove_partial(self) -> bool:
        """Remove what a failed save left under orbax's temporary names; True if there was any."""
        partial = [p for p in self.directory.iterdir() if ".orbax-checkpoint-tmp" in p.name]
        for p in partial:
            shutil.rmtree(p, ignore_errors=True)
        return bool(partial)

    def restore(self, step: int, like: Any) -> tuple[Any, dict[str, Any]]:
        """The state at `step`, shaped and sharded like `like`, and its metadata."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        with _quiet():
            out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                     meta=ocp.args.JsonRestore()))
        return out.state, out.meta

    def restore_latest(self, like: Any) -> tuple[int, Any, dict[str, Any]]:
        """The newest checkpoint that reads: (step, state, metadata). An unreadable one is moved to
        `checkpoints_unreadable/<step>` with a one-line note, and the next newest is tried. A
        checkpoint whose shapes differ from `like` stops the run (every other one would too)."""
        for step in sorted(self.manager.all_steps(read=True), reverse=True):
            try:
                state, meta = self.restore(step, like)
            except Exception as e:
                mismatch = self._shape_mismatch(step, like)
                if mismatch:
                    raise RunError(f"checkpoint step {step} does not fit this config: {mismatch} (the model or its "
                                   f"optimizer changed since the run started)") from None
                aside = self.directory.parent / "checkpoints_unreadable" / str(step)
                aside.parent.mkdir(exist_ok=True)
                shutil.move(str(self.directory / str(step)), str(aside))
                self.manager.reload()
                self.say(f"checkpoint step {step} is unreadable ({_first_line(e, 160)}); moved to {aside}, trying the "
                         f"previous one")
                continue
            return step, state, meta
        raise RunError(f"no readable checkpoint in {self.directory}: nothing to resume")

    def _shape_mismatch(self, step: int, like: Any) -> str | None:
        """'<leaf path>: stored (4, 4), config (5, 4)' for the first leaf whose shape differs, if any."""
        try:
            stored = self.manager.item_metadata(step)["state"]
        except Exception:
            return None
        ours = dict(jax.tree_util.tree_flatten_with_path(like)[0])
        theirs = dict(jax.tree_util.tree_flatten_with_path(stored)[0]) if stored is not None else {}
        for path, leaf in ours.items():
            if path in theirs and tuple(getattr(theirs[path], "shape", ())) != tuple(leaf.shape):
                return (f"{jax.tree_util.keystr(path)} is {tuple(theirs[path].shape)} in the checkpoint, "
                        f"{tuple(leaf.shape)} now")
        missing = [jax.tree_util.keystr(p) for p in ours if p not in theirs]
        if theirs and missing:
            return f"{missing[0]} is not in the checkpoint"
        return None

    def close(self) -> None:
        self.manager.close()
        _ABSL.removeHandler(self._log)
        _ABSL.propagate = self._propagate
        self._log.close()
