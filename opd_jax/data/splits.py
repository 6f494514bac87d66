"""Held-out splits by content. A problem (a built-in domain's prompt text, an environment
episode's map or secret) is held out when a hash of its content and the data seed falls below
the held-out share:

    held_out(key) = blake2b(f"{seed}\\0{key}") / 2^64 < share

Training, validation and the teachers' samples draw only problems outside that region; the
evaluation draws only problems inside it, each once. So no held-out problem is ever trained on,
whatever the streams' seeds, the number of held-out prompts asked for, or the mix of sources
(the region is a function of the content alone: an expert trained on one domain and a merge over
ten hold out the same problems). Another data seed holds out another region.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# a draw outside its region is redrawn; a region this rare in a stream means the split is unusable
_MAX_REDRAWS = 10_000


# a problem space this small is enumerated, so that exactly round(share × size) of it is held out
ENUMERABLE = 2_500


def content_hash(seed: int, key: str) -> int:
    digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclasses.dataclass(frozen=True)
class Partition:
    """Which problems are held out: those whose content hashes below `share` under `seed`; in a
    space small enough to enumerate, the round(share × size) problems of lowest hash (`cutoff`:
    the highest hash held out), so the held-out count is exact and the same for every seed."""

    seed: int = 0
    share: float = 0.25
    cutoff: int | None = None

    def held_out(self, key: str) -> bool:
        h = content_hash(self.seed, key)
        return h <= self.cutoff if self.cutoff is not None else h < self.share * 2**64

    def draw(self, split: str, attempt: Callable[[int], T], key: Callable[[T], str]) -> T | None:
        """The first of attempt(0), attempt(1), ... on `split`'s side of the partition ("eval":
        held out; anything else: not held out); None when none of the first 10,000 is (a
        problem space too small for the split)."""
        want = split == "eval"
        for n in range(_MAX_REDRAWS):
            item = attempt(n)
            if self.held_out(key(item)) == want:
                return item
        return None

    def exact(self, problems: set[str]) -> Partition:
        """This partition over a whole enumerated problem space: exactly round(share × size) held out."""
        hashes = sorted(content_hash(self.seed, k) for k in problems)
        count = min(len(hashes) - 1, max(1, round(self.share * len(hashes))))
        return dataclasses.replace(self, cutoff=hashes[count - 1])


def enumerate_space(draw: Callable[[], str], space: int) -> set[str] | None:
    """Every problem of a space of known size, by calling draw() (a random problem's key) until
    `space` distinct ones came; None if the space is too large to enumerate or the draws stall."""
    if space > ENUMERABLE:
        return None
    found: set[str] = set()
    for _ in range(200 * space + 100_000):
        found.add(draw())
        if len(found) == space:
            return found
    return None


def distinct(items: Callable[[int], T], key: Callable[[T], str], count: int, *, patience: int) -> list[T]:
    """The first `count` items of items(0), items(1), ... with distinct keys; fewer when
    `patience` items in a row bring nothing new."""
    out: list[T] = []
    seen: set[str] = set()
    index = stale = 0
    while len(out) < count and stale < patience:
        item = items(index)
        index += 1
        k = key(item)
        if k in seen:
            stale += 1
            continue
        seen.add(k)
        out.append(item)
        stale = 0
    return out
