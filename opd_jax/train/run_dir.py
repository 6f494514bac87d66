"""A run directory that cannot be mixed up.

- One process at a time: `lock` holds an exclusive `flock` on `<run_dir>/.lock` for the life of
  the run; a second process is refused with a message naming the holder (command, pid, host,
  start time).
- One command per directory: `run.json` records which command owns it (train, sft, merge), its
  status (running, finished, interrupted, failed) and every attempt. A new run never writes into
  another command's run, a finished run, or a run with checkpoints; `--resume` needs a run of
  the same command with a checkpoint.
- The config history: each attempt's resolved config is kept as `config_history/<n>.yaml`
  (`config.yaml` is the latest), so a resume never loses the config the earlier steps ran with.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opd_jax.run_files import (  # noqa: F401 (lock, checkpoint_steps: re-exported)
    MANIFEST,
    RunDirError,
    acquire_lock,
    announce_holder,
    checkpoint_steps,
    latest_checkpoint,
    lock,
    now,
)

HISTORY = "config_history"


class RunDirectory:
    """The run directory of one command invocation. `open` takes the lock and checks that this
    command may start (or resume) here; `record_config` keeps the attempt's config; `close`
    records how the attempt ended and releases the lock."""

    def __init__(self, path: str | Path, command: str):
        self.path, self.command = Path(path), command
        self._lock = None
        self.status_before: str | None = None  # the run's status before this attempt
        self.manifest: dict[str, Any] = {}

    # -- opening -------------------------------------------------------------------------------

    def open(self, *, resume: bool, check: Callable[[RunDirectory], None] | None = None) -> RunDirectory:
        """Lock the directory, check that this command may start (resume) here, run `check` (more
        checks, still before anything is written), then record the attempt in run.json."""
        if resume and not self.path.is_dir():
            raise RunDirError(f"{self.path} does not exist: nothing to resume (check logging.run_dir)")
        self._lock = acquire_lock(self.path)
        try:
            self.manifest = self._read_manifest()
            self._check(resume)
            if check is not None:
                check(self)
        except BaseException:
            self._release()
            raise
        announce_holder(self._lock, self.command)
        self.status_before = self.manifest.get("status")
        attempts = self.manifest.setdefault("attempts", [])
        if not resume and attempts:  # a same-command run that stopped before its first checkpoint
            self.manifest["attempts"] = attempts = []
        self.manifest.update(command=self.command, status="running")
        attempts.append({"started": now(), "pid": os.getpid(), "host": socket.gethostname(),
                         "argv": sys.argv, "resumed_from": self._resumed_from() if resume else None})
        self._write_manifest()
        return self

    def _resumed_from(self) -> int | str | None:
        """The step a resume continues from ("warm start step k" while only the warm start has one)."""
        steps = checkpoint_steps(self.path)
        return steps[-1] if steps else latest_checkpoint(self.path)

    def _read_manifest(self) -> dict[str, Any]:
        path = self.path / MANIFEST
        if not path.exists():
            return {}
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            raise RunDirError(f"{path} is not valid JSON; it records which command owns {self.path}: restore it or "
                              f"choose another logging.run_dir") from None

    def _check(self, resume: bool) -> None:
        owner, status = self.manifest.get("command"), self.manifest.get("status")
        latest = latest_checkpoint(self.path)
        where = str(self.path)
        if owner is not None and owner != self.command:
            raise RunDirError(f"{where} holds an `opd-jax {owner}` run ({status}); `opd-jax {self.command}` will not "
                              f"write into it: choose another logging.run_dir")
        if resume:
            if latest is None:
                raise RunDirError(f"{where} holds no checkpoint: nothing to resume (the run stopped before its "
                                  f"first one); start it again without --resume")
            return
        if status == "finished":
            raise RunDirError(f"{where} holds a finished `opd-jax {self.command}` run; choose another "
                              f"logging.run_dir (or --resume with more steps to train it further)")
        if latest is not None:
            raise RunDirError(f"{where} already holds checkpoints (latest: {latest}); pass --resume to "
                              f"continue it or choose another logging.run_dir")
        if owner is None and (self.path / "metrics.jsonl").exists():
            raise RunDirError(f"{where} holds the files of an earlier run; choose another logging.run_dir")

    # -- during the run ------------------------------------------------------------------------

    def record_config(self, text: str) -> Path:
        """Keep this attempt's resolved config (YAML text) in the history and as config.yaml."""
        number = len(self.manifest["attempts"])
        history = self.path / HISTORY
        history.mkdir(exist_ok=True)
        kept = history / f"{number}.yaml"
        kept.write_text(text)
        shutil.copyfile(kept, self.path / "config.yaml")
        self.manifest["attempts"][-1]["config"] = f"{HISTORY}/{number}.yaml"
        self._write_manifest()
        return kept

    def note(self, **fields: Any) -> None:
        """Record facts about this attempt (the engine it samples with, ...) in run.json."""
        if self._lock is None:
            return
        self.manifest["attempts"][-1].update(fields)
        self._write_manifest()

    def previous_config(self) -> str | None:
        path = self.path / "config.yaml"
        return path.read_text() if path.exists() else None

    def close(self, status: str, **details: Any) -> None:
        """Record how this attempt ended ("finished", "interrupted", "failed"; "refused": a resume
        that changed nothing, so the run keeps the status it had) and release the lock."""
        if self._lock is None:
            return
        self.manifest["status"] = (self.status_before or "failed") if status == "refused" else status
        self.manifest["attempts"][-1].update(ended=now(), status=status, **details)
        with contextlib.suppress(OSError):  # a full disk must not hide the error that ended the run
            self._write_manifest()
        self._release()

    def _write_manifest(self) -> None:
        path = self.path / MANIFEST
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.manifest, indent=2))
        tmp.replace(path)

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None
