"""OPD merge: domain experts distilled into one student (issue 6, in progress)."""

from opd_jax.merge.routing import RoutingError, check_teacher_compatible, teacher_indices

__all__ = ["RoutingError", "check_teacher_compatible", "teacher_indices"]
