"""What a run says to the person watching it: one-line notes on stderr (process 0 only) that
never tear a progress bar, and the progress bars themselves."""

from __future__ import annotations

import sys
from typing import Any

import jax
import tqdm


def say(message: str) -> None:
    """A note on stderr from process 0, printed above any progress bar."""
    if jax.process_index() == 0:
        tqdm.tqdm.write(message, file=sys.stderr)


def progress(total: int, description: str, *, initial: int = 0, enabled: bool = True, unit: str = "step") -> tqdm.tqdm:
    """A progress bar on stderr (process 0 only). smoothing=0: the rate is steps over time since
    `restart_clock`, so the ETA is the plain average, not an average dragged by one slow step."""
    return tqdm.tqdm(total=total, initial=initial, desc=description, unit=unit, dynamic_ncols=True, smoothing=0,
                     disable=not enabled or jax.process_index() != 0, file=sys.stderr)


def restart_clock(bar: tqdm.tqdm, advance: int = 0) -> None:
    """Count `advance` more steps done (the one that compiled), then the rate (and so the ETA)
    from now on: the frame shown has no rate, so never the compile's ETA."""
    bar.n += advance
    if not bar.disable:
        bar.initial = bar.n
        bar.start_t = bar._time()  # tqdm's own clock, which it reads for the rate
        # what tqdm's update() would note: close() draws its last frame (and ends the line) only
        # for a bar printed since start_t
        bar.last_print_t, bar.last_print_n = bar.start_t, bar.n
        bar.refresh()


def short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
