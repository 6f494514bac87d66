"""What a merge config resolves to before anything trains: the student's starting model, the
teachers (name, model, the domains routed to each), the prompt mix, and what the experts run
recorded. Everything a merge needs from disk is found (or named as missing) here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from opd_jax.config import DataSection, ModelSection, SourceSpec
from opd_jax.config.opd_pipeline import MergeConfig
from opd_jax.data import source_domains
from opd_jax.errors import OpdJaxError
from opd_jax.merge.experts import base_dir, expert_dir, held_out_region
from opd_jax.merge.routing import routing_table, teacher_indices


class MergeError(OpdJaxError, RuntimeError):
    """A merge that cannot start; the message says what is missing or wrong."""


@dataclasses.dataclass(frozen=True)
class TeacherSpec:
    name: str
    path: Path
    domains: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class MergePlan:
    student: ModelSection
    teachers: tuple[TeacherSpec, ...]
    data: DataSection
    routes: dict[str, int]  # domain -> position of its teacher
    base: dict[str, Any] | None = None  # the experts run's base.json
    experts: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # name -> expert.json

    @property
    def teacher_names(self) -> list[str]:
        return [t.name for t in self.teachers]


def _read_summary(path: Path, what: str, command: str) -> dict[str, Any]:
    if not path.exists():
        raise MergeError(f"{what} is not finished: {path} is missing (run `{command}`)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise MergeError(f"{path}: not valid JSON ({e})") from None


def _check_held_out(data: DataSection, trained: dict[str, dict[str, Any]]) -> None:
    """The merge's held-out problems are the ones its base and experts held out: a teacher trained
    on the merge's held-out problems would make the report's comparison a test on training data."""
    region = held_out_region(data)
    for what, summary in trained.items():
        theirs = summary.get("held_out")
        if theirs is not None and theirs != region:
            raise MergeError(f"{what} held out the problems of data.seed {theirs['seed']} at share {theirs['share']:g}, "
                             f"the merge those of data.seed {region['seed']} at share {region['share']:g}: set the "
                             f"merge's data.seed and data.held_out_share to the experts' (the experts trained on the "
                             f"merge's held-out problems otherwise)")


def resolve_plan(config: MergeConfig) -> MergePlan:
    base, experts = None, {}
    if config.experts_dir is not None:
        root = Path(config.experts_dir)
        if not root.is_dir():
            raise MergeError(f"experts_dir {root} does not exist (run `opd-jax experts CONFIG` first)")
        base = _read_summary(base_dir(root) / "base.json", "the experts' base", "opd-jax experts CONFIG --only base")
        names = sorted(p.name for p in (root / "experts").iterdir() if p.is_dir()) if (root / "experts").is_dir() else []
        if not names and not config.teachers.paths:
            raise MergeError(f"{root} holds no experts (run `opd-jax experts CONFIG`)")
        # teachers.paths may mix the run's experts with teachers from elsewhere
        wanted = [n for n in config.teachers.paths if n in names] if config.teachers.paths else names
        for name in wanted:
            experts[name] = _read_summary(expert_dir(root, name) / "expert.json", f"expert {name!r}",
                                          f"opd-jax experts CONFIG --only {name}")
    if config.teachers.paths:
        teachers = tuple(TeacherSpec(n, Path(p), tuple(config.teachers.domains.get(n) or
                                                        (experts[n]["domains"] if n in experts else [n])))
                         for n, p in config.teachers.paths.items())
    else:
        teachers = tuple(TeacherSpec(n, Path(e["model"]), tuple(e["domains"])) for n, e in experts.items())
    student = config.student or ModelSection(path=base["model"])  # the trainer's own precision
    unknown = sorted(set(config.mix) - {t.name for t in teachers})
    if unknown:
        raise MergeError(f"mix names {', '.join(unknown)}, which are not teachers ({', '.join(t.name for t in teachers)})")
    data = config.data
    if not data.train:  # the experts' own sources, weighted by mix (an expert's share split over its sources)
        sources = [SourceSpec.model_validate({**s, "weight": config.mix.get(n, 1.0) * s.get("weight", 1.0) /
                                              sum(x.get("weight", 1.0) for x in experts[n]["sources"])})
                   for n, e in experts.items() if n in {t.name for t in teachers} for s in e["sources"]]
        data = data.model_copy(update={"train": sources})
    _check_held_out(data, {"the experts' base": base or {}} | {f"expert {n!r}": e for n, e in experts.items()})
    routes = routing_table({t.name: t.domains for t in teachers})
    teacher_indices(sorted({d for s in data.train for d in source_domains(s)}), routes)  # every domain routed
    return MergePlan(student=student, teachers=teachers, data=data, routes=routes, base=base, experts=experts)
