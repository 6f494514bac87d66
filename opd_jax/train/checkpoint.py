"""Checkpoints of a run through orbax: the whole train state (policy, critic, optimizer states,
step; of a LoRA model only the adapters, its frozen base being rebuilt from the config) plus the
prompt iterator's state and how many prompt groups were drawn.

Faults are the user's to read in one line, never orbax's or tensorstore's. Orbax writes each
step under a temporary name and renames it when complete, so a kill mid-save leaves the previous
checkpoint as the latest; what a killed or failed save left behind is removed (a failed save at
once, a killed one when the next run opens the directory). Each checkpoint records, atomically
with its state, the tree it holds (every leaf's path, shape and dtype, in `meta`) and, once
committed, a SHA-256 of every file (`checksums.json`). A resume decides from these records, not
from a restore error:

- a checkpoint whose files differ from their checksums (truncated, zeroed, missing), or that does
  not restore, is unreadable: it is moved aside (`checkpoints_unreadable/`, nothing deleted) with a
  one-line note naming the file, and the next newest is tried;
- a checkpoint whose recorded tree differs from the state the config builds does not fit the
  config (`CheckpointMismatch`, naming the leaf); no checkpoint of the run would, so the run stops.

Orbax's own log lines go to `checkpoints/orbax.log`, not the terminal.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import json
import logging
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from opd_jax.core.update import joined, split_trainable
from opd_jax.run_files import write_json
from opd_jax.train import signals
from opd_jax.train.errors import RunError

_ABSL = logging.getLogger("absl")  # orbax logs through absl
CHECKSUMS = "checksums.json"  # beside orbax's items in a step's directory, written once it is committed
_TMP = ".orbax-checkpoint-tmp"  # in the names of what orbax writes before a step commits


class CheckpointMismatch(RunError):
    """A checkpoint that holds another tree than the state the config builds (a changed model or
    optimizer): every checkpoint of the run would fail the same way."""


def tree_record(tree: Any) -> dict[str, list]:
    """{leaf path: [shape, dtype]} of every leaf: what a checkpoint holds, decided without reading it."""
    return {jax.tree_util.keystr(path): [list(leaf.shape), str(leaf.dtype)]
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def tree_difference(stored: dict[str, list], ours: dict[str, list]) -> str | None:
    """The first difference between two tree records, in words; None if they have the same leaves
    and shapes (a dtype may differ: a restore casts)."""
    for path, (shape, _) in ours.items():
        if path not in stored:
            return f"{path} is not in the checkpoint"
        if list(stored[path][0]) != list(shape):
            return f"{path} is {tuple(stored[path][0])} in the checkpoint, {tuple(shape)} now"
    extra = [p for p in stored if p not in ours]
    return f"the checkpoint holds {extra[0]}, which the config does not build" if extra else None


def _file_hashes(directory: Path) -> dict[str, list]:
    """{relative path: [size, sha256]} of every file under `directory` but the checksums' own."""
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != CHECKSUMS:
            out[str(path.relative_to(directory))] = [path.stat().st_size, _sha256(path)]
    return out


def verify_files(directory: Path) -> str | None:
    """What differs between a committed checkpoint's files and the checksums recorded when it
    committed, in words (the first file); None if they agree or none were recorded."""
    try:
        recorded = json.loads((directory / CHECKSUMS).read_text())
    except FileNotFoundError:
        return None  # killed between orbax's commit and the checksums: the restore decides
    except (OSError, ValueError) as e:
        return f"{CHECKSUMS} is unreadable ({_first_line(e, 80)})"
    for name, (size, digest) in recorded.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size} bytes, {size} when saved"
        if _sha256(path) != digest:
            return f"{name} differs from what was saved (SHA-256)"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


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


def _is_state(x: Any) -> bool:
    return isinstance(x, nnx.State)


def _saved(params: Any) -> tuple[Any, Any]:
    # a DSA model's indexers are saved even where frozen: a warm start may have trained them
    # (`PolicyState.trains_indexer`), and the run that goes on from it keeps what it trained
    return split_trainable(params, indexer=True)


def trained_part(state: Any) -> Any:
    """What a checkpoint holds of a train state: every parameter tree without its frozen part (a
    LoRA model's base: `split_trainable`; GLM-5's indexers are kept), which the run rebuilds from
    its config; a state with nothing frozen is all of it."""
    return jax.tree.map(lambda x: _saved(x)[0] if _is_state(x) else x, state, is_leaf=_is_state)


def with_frozen(trained: Any, like: Any) -> Any:
    """A restored `trained_part` with the frozen parts of `like` (a fresh state of the run) put back."""
    return jax.tree.map(lambda t, fresh: joined(t, _saved(fresh)[1]) if _is_state(fresh) else t,
                        trained, like, is_leaf=_is_state)


def frozen_fingerprint(state: Any) -> list[float] | None:
    """Sums and absolute sums of every leaf of `state` a checkpoint leaves out (a LoRA model's
    base), rounded: what it records to tell that the run rebuilt the same ones.
    None when nothing is left out."""
    frozen = [_saved(x)[1] for x in jax.tree.leaves(state, is_leaf=_is_state) if _is_state(x)]
    leaves = jax.tree.leaves([f for f in frozen if f is not None])
    if not leaves:
        return None
    sums = [(jnp.sum(x.astype(jnp.float32)), jnp.sum(jnp.abs(x.astype(jnp.float32)))) for x in leaves]
    return [round(float(v), 3) for pair in jax.device_get(sums) for v in pair]


class Checkpoints:
    def __init__(self, directory: Path, keep: int, *, say: Callable[[str], None] = print):
        self.directory = directory.absolute()
        self.say = say
        self.directory.mkdir(parents=True, exist_ok=True)
        if jax.process_index() == 0:
            self._remove_partial()  # what a save killed by a second Ctrl-C (or kill -9) left behind
        self._log = _LogFile(self.directory / "orbax.log")
        _ABSL.addHandler(self._log)
        self._propagate, _ABSL.propagate = _ABSL.propagate, False
        self.manager = self._manager(keep)
        self.keep = keep
        self._abandoned = False

    def _manager(self, keep: int) -> ocp.CheckpointManager:
        # saved synchronously: a second Ctrl-C during a save then stops it here, in this thread,
        # instead of leaving orbax's writer thread behind
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
        return ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Write step `step` (its tree recorded in the metadata, its files' checksums once it is
        committed); a failure removes the partial directory and raises RunError in one line, a
        KeyboardInterrupt (a second Ctrl-C) removes it and goes on."""
        frozen = frozen_fingerprint(state)
        state = trained_part(state)
        meta = {**meta, "tree": tree_record(state), **({"frozen": frozen} if frozen is not None else {})}
        try:
            with _quiet():
                self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                                meta=ocp.args.JsonSave(meta)))
                self.manager.wait_until_finished()
            if jax.process_index() == 0:
                write_json(self.directory / str(step) / CHECKSUMS, _file_hashes(self.directory / str(step)))
        except KeyboardInterrupt:
            self._remove_partial()
            self._abandoned = True  # orbax's writer threads may still run: their complaints go to orbax.log
            # ...and recreate the step's temporary directory about 0.5 s later: remove it again as
            # they do, and once more as the process ends
            signals.at_exit_at_once(self._remove_partial)
            deadline = time.monotonic() + 1.5
            with contextlib.suppress(KeyboardInterrupt):
                while time.monotonic() < deadline:
                    time.sleep(0.1)
                    self._remove_partial()
            raise
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
        """Remove what a failed or killed save left under orbax's temporary names (and a committed
        step's half-written checksums); True if there was any."""
        partial = [p for p in self.directory.iterdir() if _TMP in p.name]
        partial += list(self.directory.glob(f"*/{Path(CHECKSUMS).stem}.tmp"))  # write_json's temporary name
        for p in partial:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        return bool(partial)

    def restore(self, step: int, like: Any) -> tuple[Any, dict[str, Any]]:
        """The state at `step`, shaped and sharded like `like` (its frozen parts `like`'s own), and
        its metadata."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, trained_part(like))
        with _quiet():
            out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                     meta=ocp.args.JsonRestore()))
        meta = dict(out.meta)
        meta.pop("tree", None)
        frozen = meta.pop("frozen", None)
        if frozen is not None and frozen != frozen_fingerprint(like):
            raise CheckpointMismatch(f"checkpoint step {step} holds adapters trained on another base than the one "
                                     f"this run built (model.path's weights changed since?); resume on that base")
        return with_frozen(out.state, like), meta

    def _recorded_tree(self, step: int) -> dict[str, list] | None:
        """The tree step `step` recorded (None for a checkpoint saved before trees were recorded);
        an OSError/ValueError if its metadata does not read."""
        with _quiet():
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        return meta.get("tree")

    def restore_latest(self, like: Any) -> tuple[int, Any, dict[str, Any]]:
        """The newest checkpoint that reads: (step, state, metadata). An unreadable one (files that
        differ from their checksums, metadata or arrays that do not restore) is moved to
        `checkpoints_unreadable/<step>` with a one-line note, and the next newest is tried. A
        checkpoint whose recorded tree differs from `like`, or whose adapters were trained on
        another frozen base, raises CheckpointMismatch."""
        ours = tree_record(trained_part(like))
        for step in sorted(self.manager.all_steps(read=True), reverse=True):
            problem = verify_files(self.directory / str(step))
            if problem is None:
                try:
                    stored = self._recorded_tree(step)
                except Exception as e:
                    problem = f"its metadata does not read: {_first_line(e, 160)}"
            if problem is None:
                difference = stored is not None and tree_difference(stored, ours)
                if difference:
                    raise CheckpointMismatch(f"checkpoint step {step} does not fit this config: {difference}")
                try:
                    state, meta = self.restore(step, like)
                    return step, state, meta
                except CheckpointMismatch:
                    raise
                except Exception as e:
                    problem = _first_line(e, 160)
            self._set_aside(step, problem)
        raise RunError(f"no readable checkpoint in {self.directory}: nothing to resume")

    def _set_aside(self, step: int, problem: str) -> None:
        aside = self.directory.parent / "checkpoints_unreadable" / str(step)
        aside.parent.mkdir(exist_ok=True)
        if aside.exists():  # set aside before under the same step, by an earlier attempt
            aside = aside.with_name(f"{step}.{len(list(aside.parent.glob(f'{step}.*'))) + 1}")
        shutil.move(str(self.directory / str(step)), str(aside))
        self.manager.reload()
        self.say(f"checkpoint step {step} is unreadable ({problem}); moved to {aside}, trying the previous one")

    def close(self) -> None:
        if self._abandoned:  # a save cut by a second Ctrl-C: the process ends at once, its log stays in orbax.log
            return
        self.manager.close()
        _ABSL.removeHandler(self._log)
        _ABSL.propagate = self._propagate
        self._log.close()
