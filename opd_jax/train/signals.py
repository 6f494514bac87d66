"""Stop at a step boundary on SIGINT (Ctrl-C) or SIGTERM (what schedulers send): the handlers
only record the request; the run loop saves a checkpoint at the next boundary and stops. A
second Ctrl-C stops at once (KeyboardInterrupt)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

from opd_jax.train.errors import Interrupted

_requested: list[int] = []
_depth: list[int] = []  # blocks entered and not left (one entry each)
_before_exit: list[Callable[[], None]] = []  # what a command stopped at once does last (see at_exit_at_once)


def at_exit_at_once(fn: Callable[[], None]) -> None:
    """Have `fn` called just before a command stopped by a second Ctrl-C ends its process (`run_last`):
    what threads left running (orbax's writers) may recreate until then gets removed once more."""
    _before_exit.append(fn)


def run_last() -> None:
    """Call what `at_exit_at_once` registered (errors ignored: the process is ending)."""
    for fn in _before_exit:
        with contextlib.suppress(Exception):
            fn()


def requested() -> str | None:
    """The name of the signal that asked the run to stop (SIGINT, SIGTERM), or None."""
    return signal.Signals(_requested[0]).name if _requested else None


def exit_status() -> int:
    """The shell's status for a process stopped by the requested signal: 128 + its number."""
    return 128 + (_requested[0] if _requested else signal.SIGINT)


def stop_if_requested(during: str, restart_hint: str = "run the same command again") -> None:
    """Between two steps of a phase that keeps nothing until it ends (a warm start, the merge's
    teacher samples): raise `Interrupted` if a stop was requested, saying where and how to restart."""
    if _requested:
        raise Interrupted(f"{requested()} during {during}: no checkpoint yet; to start over, {restart_hint}",
                          exit_status())


# Python runs a handler once for any number of the same signal that arrived during one long C call
# (a short checkpoint save): the wakeup fd gets a byte per signal delivered, so two Ctrl-C count as two
_wakeup: list[int] = []  # the read end of the wakeup pipe while a block is active


def _delivered_sigints() -> int:
    """How many SIGINTs the process received since the last call (from the wakeup pipe's bytes)."""
    if not _wakeup:
        return 1
    count = 0
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(_wakeup[0], 512):
            count += chunk.count(signal.SIGINT)
    return max(count, 1)


def _handle(signum: int, frame) -> None:
    sigints = _delivered_sigints() if signum == signal.SIGINT else 0
    if signum == signal.SIGINT and (_requested or sigints > 1):
        raise KeyboardInterrupt
    _requested.append(signum)


@contextlib.contextmanager
def stop_at_step_boundary() -> Iterator[None]:
    """Within this block SIGINT and SIGTERM are recorded (see `requested`), not fatal. Outside the
    main thread (a notebook's worker, say) signals cannot be caught, and nothing changes. Nested
    (a run's warm start, itself a run), the outer block's handlers and requests stay."""
    if threading.current_thread() is not threading.main_thread() or _depth:
        _depth.append(1)
        try:
            yield
        finally:
            _depth.pop()
        return
    _requested.clear()
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    _wakeup.append(read)
    previous = {s: signal.signal(s, _handle) for s in (signal.SIGINT, signal.SIGTERM)}
    _depth.append(1)
    try:
        yield
    finally:
        _depth.pop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(previous_fd)
        _wakeup.clear()
        os.close(read)
        os.close(write)
        _requested.clear()
