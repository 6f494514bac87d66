"""Which teacher scores which prompt, and whether a teacher can score the student's tokens at
all. Checked before any training starts, so a bad merge config fails with a clear message."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from opd_jax.errors import OpdJaxError
from opd_jax.models import Tokenizer


class RoutingError(OpdJaxError, ValueError):
    """A prompt with no teacher, or a teacher that cannot score the student's tokens."""


def routing_table(teacher_domains: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """domain -> the position (in `teacher_domains`' order) of the teacher trained on it. A
    domain claimed by two teachers is an error: each prompt must have exactly one teacher."""
    routes: dict[str, int] = {}
    names = list(teacher_domains)
    for i, name in enumerate(names):
        for domain in teacher_domains[name]:
            if domain in routes:
                raise RoutingError(f"domain {domain!r} has two teachers: {names[routes[domain]]!r} and {name!r}")
            routes[domain] = i
    return routes


def teacher_indices(domains: Sequence[str], routes: Mapping[str, int]) -> np.ndarray:
    """int32 [B]: for each row, the position of its domain's teacher (`routes`, from
    routing_table). Every domain without a teacher is named."""
    missing = sorted({d for d in domains if d not in routes})
    if missing:
        raise RoutingError(f"no teacher for domain(s) {', '.join(missing)}; the teachers cover: "
                           f"{', '.join(sorted(routes))}")
    return np.asarray([routes[d] for d in domains], np.int32)


def check_teacher_compatible(name: str, teacher_vocab: int, teacher_tokenizer: Tokenizer | None,
                             student_vocab: int, student_tokenizer: Tokenizer,
                             probes: Mapping[str, str] | None = None) -> None:
    """The teacher must score the student's token ids as the same tokens: the same vocabulary
    size, and the same ids for the student's vocabulary and for a few probe strings."""
    if teacher_vocab != student_vocab:
        raise RoutingError(f"teacher {name!r} has a vocabulary of {teacher_vocab} tokens, the student {student_vocab}")
    if teacher_tokenizer is None:
        raise RoutingError(f"teacher {name!r} has no tokenizer to compare with the student's")
    student, teacher = student_tokenizer.backend.get_vocab(), teacher_tokenizer.backend.get_vocab()
    differ = sorted(t for t in student if teacher.get(t) != student[t])
    if differ:
        raise RoutingError(f"teacher {name!r} maps {len(differ)} of the student's tokens to other ids "
                           f"(e.g. {differ[:3]}); OPD needs the student's tokenizer")
    for label, text in (probes or {"digits": "0123456789", "words": "What is 7 + 5?"}).items():
        if teacher_tokenizer.encode(text) != student_tokenizer.encode(text):
            raise RoutingError(f"teacher {name!r} tokenizes the {label} probe {text!r} differently from the student")
