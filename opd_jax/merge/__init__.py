"""OPD merge: domain experts trained by RL from one base, distilled into one student by
multi-teacher on-policy distillation, judged against weight-space merging."""

from pathlib import Path

from opd_jax.merge.experts import ExpertsError, run_experts
from opd_jax.merge.loop import merge
from opd_jax.merge.plan import MergeError, MergePlan, TeacherSpec, resolve_plan
from opd_jax.merge.routing import RoutingError, check_teacher_compatible, routing_table, teacher_indices
from opd_jax.merge.teachers import LocalTeachers, SGLangTeachers, TeacherError
from opd_jax.train import RunError


def read_report_table(run_dir: str | Path) -> str:
    """The per-domain table of a finished merge (report.md), or a note that it has none."""
    path = Path(run_dir) / "report.md"
    return path.read_text() if path.exists() else f"(no report in {run_dir})"


__all__ = ["ExpertsError", "LocalTeachers", "MergeError", "MergePlan", "RoutingError", "RunError",
           "SGLangTeachers", "TeacherError", "TeacherSpec", "check_teacher_compatible", "merge", "read_report_table",
           "resolve_plan", "routing_table", "run_experts", "teacher_indices"]
