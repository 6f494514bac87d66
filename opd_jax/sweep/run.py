"""`opd-jax sweep`: every cell × seed of a sweep as its own `opd-jax train` (or `opd-jax merge`)
process, several at a time, each in its own run directory (<out>/<cell>/seed<k>), then the aggregate.
With `--in-process` the same commands run one after another in the sweep's own process instead:
for many short runs, whose start (imports, the first compiles) is most of their time.

Resumable: a run whose run.json says finished is kept as it is; one with checkpoints continues
from the last (`--resume`); anything else starts over. With `warm_start: shared` each distinct
warm start runs once first (<out>/_warm_start/<key>, kept once finished) and its runs start from
its model. Every cell's config is resolved before a single run starts, so a bad key or value
stops the sweep with one line naming the cell. A run that fails is reported with its log
(<out>/<cell>/seed<k>.log) and left out of the aggregate; the others go on.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from opd_jax.config import ConfigError, MergeConfig, TrainConfig, load_config, to_plain
from opd_jax.config.sweep import SweepConfig
from opd_jax.errors import OpdJaxError
from opd_jax.run_files import checkpoint_steps, lock, run_status
from opd_jax.sweep import stats
from opd_jax.sweep.report import write_report


class SweepError(OpdJaxError, RuntimeError):
    """A sweep that cannot start, or runs that failed (the message names them and their logs)."""


def _dotted(overrides: dict[str, Any]) -> list[str]:
    """key=value overrides; a value that is not a string written as JSON (which YAML reads back)."""
    return [f"{key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in overrides.items()]


class Sweep:
    """A loaded sweep: its config, where its base config and results are, and each run's command."""

    def __init__(self, path: str | Path, out: str | Path | None = None):
        path = Path(path)
        self.config: SweepConfig = load_config(path, schema=SweepConfig)
        self.base = (path.parent / self.config.base).resolve()
        self.out = Path(out or self.config.out or Path("runs") / "sweeps" / path.stem).resolve()
        self.cells = self.config.cell_overrides()
        self.warm_starts: dict[tuple[str, int], Path] = {}  # (cell, seed) -> its shared warm start
        self.steps: dict[tuple[str, int], int] = {}  # (cell, seed) -> the steps its run trains
        # every cell must resolve before anything runs; a problem is named where it was written
        self._resolve(path, f"base {self.base}", [])
        self._resolve(path, "overrides", _dotted(self.config.overrides))
        for name, overrides in self.cells:
            for seed in self.config.seed_list:
                config = self._resolve(path, f"cell {name}", self.overrides(overrides, seed))
                self.steps[name, seed] = config.steps
                if self.config.warm_start == "shared" and config.sft.steps > 0:
                    self.warm_starts[name, seed] = self.out / "_warm_start" / _warm_start_key(config)
        try:
            self.config = self.config.checked()
        except ValueError as e:
            raise SweepError(f"{path}: {e}") from None

    def _resolve(self, path: Path, where: str, overrides: list[str]) -> Any:
        try:
            return load_config(self.base, overrides, schema=self.schema)
        except ConfigError as e:
            problem = str(e).removeprefix(f"invalid config {self.base}:").strip()
            raise SweepError(f"{path}: {where}: {problem}") from None

    @property
    def schema(self) -> type[TrainConfig] | type[MergeConfig]:
        return TrainConfig if self.config.command == "train" else MergeConfig

    def overrides(self, cell: dict[str, Any], seed: int) -> list[str]:
        return [*_dotted(self.config.overrides), *_dotted(cell), *(f"{k}={seed}" for k in self.config.seed_key_list)]

    def warm_start_commands(self, runs: list[tuple[str, int]]) -> dict[Path, list[str]]:
        """The `opd-jax sft` command of every shared warm start these (cell, seed) runs need that is
        not finished yet, by its directory."""
        commands = {}
        cells = dict(self.cells)
        for name, seed in runs:
            where = self.warm_starts.get((name, seed))
            if where is not None and where not in commands and run_status(where) != "finished":
                # the warm start prepares the base (every weight trains): a LoRA run's adapters go on it
                commands[where] = [sys.executable, "-m", "opd_jax.cli", "sft", str(self.base),
                                   *self.overrides(cells[name], seed), "model.lora=null", f"logging.run_dir={where}",
                                   "logging.progress_bar=false"]
        return commands

    @property
    def cache(self) -> Path:
        """The sweep's persistent compilation cache (see `_execute`)."""
        return self.out / "_jax_cache"

    def run_dir(self, cell: str, seed: int) -> Path:
        return self.out / cell / f"seed{seed}"

    def finished(self, cell: str, seed: int) -> bool:
        """Whether the run finished every step the sweep now asks of it."""
        run_dir = self.run_dir(cell, seed)
        return run_status(run_dir) == "finished" and _trained_steps(run_dir) >= self.steps[cell, seed]

    def command(self, cell: str, overrides: dict[str, Any], seed: int) -> list[str] | None:
        """The train (or merge) command of one run (None: it finished already). A run that finished fewer steps
        than the sweep now asks for (its `steps` raised) is resumed to train the rest."""
        run_dir = self.run_dir(cell, seed)
        if self.finished(cell, seed):
            return None
        resume = bool(checkpoint_steps(run_dir))
        warm = self.warm_starts.get((cell, seed))
        start = [] if warm is None else ["model.fresh=null", f"model.path={warm / 'sft_policy'}", "sft.steps=0"]
        return [sys.executable, "-m", "opd_jax.cli", self.config.command, str(self.base), *self.overrides(overrides, seed),
                *start,
                f"logging.run_dir={run_dir}", "logging.progress_bar=false", *(["--resume"] if resume else [])]


def reduced(path: str | Path, out: str | Path, *, seeds: int | list[int] = 2, overrides: dict[str, Any] | None = None,
            keep: dict[str, list[Any]] | None = None, cells: dict[str, dict[str, Any]] | None = None) -> Sweep:
    """A smaller copy of the sweep file at `path`, written to <out>.yaml, its runs in `out`: other
    `seeds`, extra `overrides` for every cell, only the grid values / axis labels named in `keep`
    (by grid key or axis name; values compared as strings), `cells` in place of its named cells
    when given, and only the comparisons (and primary contrasts) whose cells remain. The notebooks' test size; a
    smoke test of a sweep before its hours-long run."""
    path, out = Path(path), Path(out)
    spec = yaml.safe_load(path.read_text())
    spec.update(base=str((path.parent / spec["base"]).resolve()), seeds=seeds, out=None)
    spec["overrides"] = {**spec.get("overrides", {}), **(overrides or {})}
    for key, wanted in (keep or {}).items():
        where = "axes" if key in spec.get("axes", {}) else "grid"
        if key not in spec.get(where, {}):
            raise SweepError(f"{path}: no grid key or axis {key!r} to keep values of")
        values = spec[where][key]
        spec[where][key] = ({k: v for k, v in values.items() if str(k) in map(str, wanted)} if where == "axes"
                            else [v for v in values if str(v) in map(str, wanted)])
    if cells is not None:
        spec["cells"] = [{"name": name, "overrides": o} for name, o in cells.items()]
    compare, primary = spec.pop("compare", []), spec.pop("primary", None)
    names = {name for name, _ in SweepConfig(**spec).cell_overrides()}
    spec["compare"] = [pair for pair in compare if set(pair) <= names]
    if primary is not None:  # the declared contrasts among the cells kept; none kept: no primary outcome
        contrasts = [pair for pair in primary["contrasts"] if set(pair) <= names]
        if contrasts:
            spec["primary"] = {**primary, "contrasts": contrasts}
    small = out.with_suffix(".yaml")
    small.parent.mkdir(parents=True, exist_ok=True)
    small.write_text(yaml.safe_dump(spec, sort_keys=False))
    return Sweep(small, out)


def _warm_start_key(config: TrainConfig) -> str:
    """What a warm start depends on (the model, the data and its seed, the sft settings, how an
    episode's turns are cut), hashed: runs with the same key share one."""
    plain = to_plain(config)
    inputs = {section: plain[section] for section in ("model", "sft", "data")}
    inputs["model"] = {k: v for k, v in inputs["model"].items() if k != "lora"}  # adapters go on the shared base
    inputs["mesh"] = plain["mesh"]
    inputs.update(max_new_tokens=plain["rollout"]["max_new_tokens"], episodes=plain["rollout"]["episodes"])
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:12]


@contextlib.contextmanager
def _pool(jobs: int) -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    """A pool of `jobs` threads that, on Ctrl-C, starts none of the runs still queued (a plain
    executor's exit would wait for all of them) and waits for the running ones, which got the
    signal too and stop at a step boundary."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _execute(command: list[str], run_dir: Path, cache: Path) -> int:
    """Run one command, its output appended to <run_dir>.log; its exit status. The runs of a sweep
    compile the same programs: a persistent compilation cache they share (unless the caller's
    environment names one) spares all but the first their compiles."""
    log = run_dir.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {"JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5", **os.environ}
    with log.open("a") as out:
        return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env).returncode


def _execute_here(command: list[str], run_dir: Path) -> int:
    """Run one `opd-jax` command line in this process (the command's own code, as its process would
    run it), its output appended to <run_dir>.log; its exit status. Programs compiled by one run are
    found in memory by the next. A stop it was asked for (SIGINT, SIGTERM: the run checkpoints at a
    step boundary, as alone) stops the sweep too: KeyboardInterrupt."""
    from opd_jax.cli import app  # the command line's entry, not the loop under it

    log = run_dir.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = app(command[3:], standalone_mode=False)  # command[:3]: python -m opd_jax.cli
        except Exception:  # a bug: its traceback in the log, as its process would have left it; the others go on
            traceback.print_exc()
            status = 1
    status = status if isinstance(status, int) else 0
    if status in (130, 128 + signal.SIGTERM):
        raise KeyboardInterrupt
    return status


def _trained_steps(run_dir: Path) -> int:
    """The steps a run's config asked of it (its last attempt's config.yaml)."""
    try:
        return int(yaml.safe_load((run_dir / "config.yaml").read_text())["steps"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return 0


def _wall_seconds(run_dir: Path) -> tuple[float, float]:
    """The run's wall time over all its attempts, and the part of it spent in steps after the first
    (wall_time.json's phases: the latter leaves out compiles, evaluations and checkpoints, which a
    shared compilation cache makes differ between a sweep's first run of a shape and the rest).
    NaN where the run has no such record."""
    try:
        phases = json.loads((run_dir / "wall_time.json").read_text())
        return float(sum(phases.values())), float(phases.get("steps", math.nan))
    except (OSError, json.JSONDecodeError, TypeError, AttributeError):
        return math.nan, math.nan


@contextlib.contextmanager
def claimed(sweep: Sweep) -> Iterator[None]:
    """The sweep's directory locked as a run's is (`<out>/.lock`): a second `opd-jax sweep` on the
    same directory is refused, naming the first, instead of racing it for the same runs."""
    handle = lock(sweep.out, "sweep", key="--out (or the sweep's out)")
    try:
        yield
    finally:
        handle.close()


def aggregate_only(sweep: Sweep) -> dict[str, Any]:
    """`opd-jax sweep --aggregate-only`: the aggregate of the runs already in the sweep's
    directory; SweepError where there is none (nothing is created)."""
    if not any(sweep.finished(cell, seed) for cell, _ in sweep.cells for seed in sweep.config.seed_list):
        where = "does not exist" if not sweep.out.is_dir() else "holds no finished run of this sweep"
        raise SweepError(f"--aggregate-only: {sweep.out} {where}: nothing to aggregate (run the sweep first)")
    with claimed(sweep):
        return aggregate(sweep)


def run_sweep(sweep: Sweep, jobs: int = 1, echo=print, in_process: bool = False) -> dict[str, Any]:
    """Run what is not finished, `jobs` at a time (each its own process) or, `in_process`, one
    after another in this one (`_execute_here`), then aggregate (`aggregate`); SweepError naming
    the runs that failed, after the aggregate of the others is written. The sweep's directory is
    locked meanwhile (`claimed`)."""
    if jobs < 1:
        raise SweepError(f"--jobs must be >= 1, got {jobs}")
    if in_process and jobs > 1:
        raise SweepError(f"--in-process runs one run at a time, in this process: drop --jobs {jobs} (or --in-process)")
    with claimed(sweep):
        return _run_sweep(sweep, jobs, echo, in_process)


def _run_sweep(sweep: Sweep, jobs: int, echo, in_process: bool) -> dict[str, Any]:
    todo = [(cell, overrides, seed, command) for cell, overrides in sweep.cells for seed in sweep.config.seed_list
            if (command := sweep.command(cell, overrides, seed)) is not None]
    total = len(sweep.cells) * len(sweep.config.seed_list)
    echo(f"sweep {sweep.out}: {len(sweep.cells)} cells x {len(sweep.config.seed_list)} seeds, "
         f"{total - len(todo)} runs finished, {len(todo)} to run ({jobs} at a time)")
    failed = []
    warm = sweep.warm_start_commands([(cell, seed) for cell, _, seed, _ in todo])
    if warm:
        echo(f"  {len(warm)} shared warm start(s) first")
    def execute(command: list[str], run_dir: Path) -> int:
        return _execute_here(command, run_dir) if in_process else _execute(command, run_dir, sweep.cache)

    def each(pool: concurrent.futures.ThreadPoolExecutor, fn, items) -> Iterator:
        # in-process runs stay in the main thread, the only one where a run's signal handling works
        return map(fn, items) if in_process else pool.map(fn, items)

    with _pool(jobs) as pool:
        statuses = each(pool, lambda where: execute(warm[where], where), warm)
        for where, status in zip(warm, statuses):
            if status != 0:
                failed.append(f"warm start {where.name} ({where.with_suffix('.log')})")
    broken = {w for w in warm if run_status(w) != "finished"}
    skipped = [(cell, seed) for cell, _, seed, _ in todo if sweep.warm_starts.get((cell, seed)) in broken]
    failed += [f"{cell} seed {seed} (its warm start failed)" for cell, seed in skipped]
    todo = [item for item in todo if (item[0], item[2]) not in skipped]

    def launch(item) -> tuple[str, int, int]:
        cell, _, seed, command = item
        return cell, seed, execute(command, sweep.run_dir(cell, seed))

    with _pool(jobs) as pool:
        for cell, seed, status in each(pool, launch, todo):
            echo(f"  {cell} seed {seed}: {'finished' if status == 0 else f'failed (exit {status})'}")
            if status != 0:
                failed.append(f"{cell} seed {seed} ({sweep.run_dir(cell, seed).with_suffix('.log')})")
    result = aggregate(sweep)
    if failed:
        raise SweepError(f"{len(failed)} of {total} runs failed, left out of {sweep.out / 'sweep.md'}: "
                         + "; ".join(failed))
    return result


def aggregate(sweep: Sweep) -> dict[str, Any]:
    """sweep.json, sweep.md and curves.png in the sweep's directory from the finished runs: per
    run its figures and collapse steps, per cell their intervals over seeds and collapse
    incidence, and the configured paired comparisons. Returns what sweep.json holds."""
    config = sweep.config
    cells: dict[str, Any] = {}
    for name, overrides in sweep.cells:
        runs = {}
        for seed in config.seed_list:
            run_dir = sweep.run_dir(name, seed)
            if sweep.finished(name, seed):
                rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
                runs[seed] = stats.run_summary(rows, config.eval_metric, config.metrics, config.collapse)
                runs[seed]["wall_s"], runs[seed]["steps_s"] = _wall_seconds(run_dir)
        cells[name] = {"overrides": overrides, "runs": runs,
                       "summary": stats.cell_summary(runs, config.metrics, config.confidence),
                       "curve": stats.curve_band(runs, config.confidence)}
    comparisons = []
    for a, b in config.compare:
        final = {n: {s: r.get("final", math.nan) for s, r in cells[n]["runs"].items()} for n in (a, b)}
        comparisons.append({"a": a, "b": b, "metric": f"final {config.eval_metric}",
                            **stats.paired(final[a], final[b], config.confidence)})
    primary = None
    if config.primary is not None:
        primary = {"declared": config.primary.model_dump(mode="json"),
                   "results": stats.primary_tests({n: c["runs"] for n, c in cells.items()}, config.primary,
                                                  config.confidence)}
    result = {"base": str(sweep.base), "eval_metric": config.eval_metric, "metrics": config.metrics,
              "confidence": config.confidence, "seeds": config.seed_list, "primary": primary, "cells": cells,
              "comparisons": comparisons}
    for cell in cells.values():  # JSON keys are strings; keep the seeds as the runs are named
        cell["runs"] = {str(s): r for s, r in cell["runs"].items()}
    write_report(sweep.out, result)
    return result
