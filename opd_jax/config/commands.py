"""The commands that read a config, once: each with its schema and whether `opd-jax k8s render`
can run it on a cluster. The CLI (`--kind`), the k8s renderer and the config reference
(docs/config.md) read this table; nothing else lists them."""

from __future__ import annotations

import dataclasses

from pydantic import BaseModel

from opd_jax.config.load import ConfigError
from opd_jax.config.opd_pipeline import ExpertsConfig, MergeConfig, RecipeConfig
from opd_jax.config.schema import TrainConfig


@dataclasses.dataclass(frozen=True)
class Command:
    name: str
    schema: type[BaseModel]
    on_cluster: bool  # a JobSet of it renders (a recipe is one process, every phase: it has none)
    # a config is this command's when its top-level keys hold every key of one of these sets
    # (the most specific command first, see command_of; train, with none, is the default)
    markers: tuple[frozenset[str], ...] = ()

    def marks(self, keys: set[str]) -> bool:
        return any(m <= keys for m in self.markers)


COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("train", TrainConfig, on_cluster=True),
    Command("experts", ExpertsConfig, on_cluster=True, markers=(frozenset({"experts"}),)),
    Command("merge", MergeConfig, on_cluster=True,
            markers=tuple(frozenset({k}) for k in ("experts_dir", "teachers", "student", "baselines"))),
    Command("recipe", RecipeConfig, on_cluster=False, markers=(frozenset({"domains", "merge"}),)),
)}


def command_of(keys: set[str]) -> Command:
    """The command a config is for, from its top-level keys: a recipe (which also names its
    experts and merge) before the commands it chains, then by markers; else train."""
    ordered = sorted(COMMANDS.values(), key=lambda c: -max((len(m) for m in c.markers), default=0))
    return next((c for c in ordered if c.marks(keys)), COMMANDS["train"])


def command_schemas(*, on_cluster: bool = False) -> dict[str, type[BaseModel]]:
    """{command: its config schema}, of every command (or those a cluster runs)."""
    return {name: c.schema for name, c in COMMANDS.items() if c.on_cluster or not on_cluster}


def schema_of(kind: str, *, on_cluster: bool = False) -> type[BaseModel]:
    """The schema of command `kind`; ConfigError listing the commands otherwise."""
    schemas = command_schemas(on_cluster=on_cluster)
    if kind not in schemas:
        raise ConfigError(f"--kind {kind!r}: use one of {', '.join(schemas)}")
    return schemas[kind]
