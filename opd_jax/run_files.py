"""What a run directory's files say about its progress, read without starting anything (no JAX):
its completed checkpoints and the status run.json records. The run loop writes them
(opd_jax.train.run_dir); the shells that decide whether to start, resume or skip a run read them
here (the sweep, which must not import the trainer, included)."""

from __future__ import annotations

import json
from pathlib import Path

MANIFEST = "run.json"


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The steps of the completed checkpoints in a run directory (orbax names each by its step and
    writes it under a temporary name until complete), newest last."""
    directory = Path(run_dir) / "checkpoints"
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def run_status(run_dir: Path) -> str | None:
    """The status run.json records (running, finished, interrupted, failed; a killed run stays
    "running"), or None where there is no run. A run is done when this says "finished"."""
    try:
        return json.loads((Path(run_dir) / MANIFEST).read_text()).get("status")
    except (OSError, json.JSONDecodeError):
        return None
