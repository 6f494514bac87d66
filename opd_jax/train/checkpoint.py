"""Checkpoints of a run through orbax: the whole PPO state (policy, critic, both optimizer
states, step) plus the prompt iterator's state and how many prompt groups were drawn. Orbax writes each step to a
temporary directory and renames it when complete, so a kill mid-save leaves the previous
checkpoint as the latest one that loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from opd_jax.train.errors import RunError


class Checkpoints:
    @classmethod
    def for_run(cls, run_dir: Path, keep: int, resume: bool) -> tuple[Checkpoints, int | None]:
        """The checkpoints of a run directory and the step to resume from (None: a new run). A
        directory that already holds checkpoints is refused unless `resume`: nothing is lost."""
        checkpoints = cls(run_dir / "checkpoints", keep)
        start = checkpoints.latest_step()
        if start is not None and not resume:
            checkpoints.close()
            raise RunError(f"{run_dir} already holds checkpoints (latest: step {start}); pass --resume to "
                                 f"continue it or choose another logging.run_dir")
        return checkpoints, start

    def __init__(self, directory: Path, keep: int):
        self.manager = ocp.CheckpointManager(
            directory.absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()

    def restore(self, step: int, like: Any) -> tuple[Any, dict[str, Any]]:
        """The state at `step`, shaped and sharded like `like`, and its metadata."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 meta=ocp.args.JsonRestore()))
        return out.state, out.meta

    def close(self) -> None:
        self.manager.close()
