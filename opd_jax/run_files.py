"""What a run directory's files say about its progress, read without starting anything (no JAX):
its completed checkpoints and the status run.json records; and the lock that keeps one process in
a directory. The run loop writes them (opd_jax.train.run_dir); the shells that decide whether to
start, resume or skip a run read them here, and lock their own directories with the same lock
(the sweep, which must not import the trainer, included)."""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

from opd_jax.errors import OpdJaxError

MANIFEST = "run.json"
LOCK = ".lock"


class RunError(OpdJaxError, RuntimeError):
    """A run that must stop; the message says why."""


class RunDirError(RunError):
    """A run directory that this command may not use (in use, another command's, finished, ...)."""


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def lock(run_dir: Path, command: str, key: str = "logging.run_dir") -> Any:
    """An exclusive lock on the directory (created if missing), released when the returned file
    is closed (or the process dies). A held lock raises RunDirError naming its holder."""
    handle = acquire_lock(run_dir, key)
    announce_holder(handle, command)
    return handle


def acquire_lock(run_dir: Path, key: str = "logging.run_dir") -> Any:
    """The directory's lock (see `lock`); `key`: the setting that names the directory, for the messages."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        handle = (run_dir / LOCK).open("a+")
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise
        why = "it is a file, not a directory" if run_dir.exists() and not run_dir.is_dir() else \
            f"{e.strerror or e}{f' ({e.filename})' if e.filename and Path(e.filename) != run_dir else ''}"
        raise RunDirError(f"cannot use {run_dir} as the run directory: {why}; choose another ({key})") \
            from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        handle.seek(0)
        try:
            holder = json.loads(handle.read() or "{}")
        except json.JSONDecodeError:
            holder = {}
        handle.close()
        who = (f"`opd-jax {holder.get('command', '?')}` (pid {holder.get('pid', '?')} on {holder.get('host', '?')}, "
               f"since {holder.get('since', '?')})")
        raise RunDirError(f"{run_dir} is in use by {who}; wait for it to end or choose another {key}") from None
    return handle


def announce_holder(handle: Any, command: str) -> None:
    """Say in the lock file who holds it (what a refused process reports)."""
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"command": command, "pid": os.getpid(), "host": socket.gethostname(), "since": now()}))
    handle.flush()



def write_json(path: Path, value: Any) -> None:
    """`value` as JSON at `path`, written whole or not at all (through `<path stem>.tmp`): a kill
    mid-write never leaves half a file behind."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=2))
    tmp.replace(path)


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The steps of the completed checkpoints in a run directory (orbax names each by its step and
    writes it under a temporary name until complete), newest last."""
    directory = Path(run_dir) / "checkpoints"
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


WARM_START = "warm_start"  # `opd-jax train`'s supervised warm start: a run directory of its own inside the run's
WARM_UP = "warm_up"  # `opd-jax merge`'s warm-up on the teachers' samples, likewise
PHASES = {WARM_START: "warm start", WARM_UP: "warm-up"}


def latest_checkpoint(run_dir: Path) -> str | None:
    """The newest checkpoint a run can resume from, in words ("step 4", or "warm start step 20"
    while only its supervised phase has checkpoints); None when it has none."""
    steps = checkpoint_steps(run_dir)
    if steps:
        return f"step {steps[-1]}"
    for directory, name in PHASES.items():
        phase = checkpoint_steps(Path(run_dir) / directory)
        if phase:
            return f"{name} step {phase[-1]}"
    return None


def run_status(run_dir: Path) -> str | None:
    """The status run.json records (running, finished, interrupted, failed; a killed run stays
    "running"), or None where there is no run. A run is done when this says "finished"."""
    try:
        return json.loads((Path(run_dir) / MANIFEST).read_text()).get("status")
    except (OSError, json.JSONDecodeError):
        return None
