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


def restart_clock(bar: tqdm.tqdm) -> None:
    """Count the rate (and so the ETA) from now on: called after the step that compiled."""
    if not bar.disable:
        bar.initial = bar.n
        bar.start_t = bar._time()  # tqdm's own clock, which it reads for the rate
        bar.refresh()


def short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
