"""`opd-jax experts`: the shared base (a supervised warm start on every expert's prompts), then
one RL expert per domain trained from it by the training loop, as independent jobs.

    RUN_DIR/base/model/          the base, a Hugging Face directory
    RUN_DIR/base/base.json       {"model", "eval": {domain: accuracy}, "wall_time_s"}
    RUN_DIR/experts/NAME/        the expert's training run (metrics, checkpoints, hf_policy/)
    RUN_DIR/experts/NAME/expert.json   {"name", "model", "domains", "sources", "eval", "wall_time_s", ...}
    RUN_DIR/experts.json         all of the above, once every expert is done

Every phase is resumable: a finished base or expert is kept, an expert with checkpoints
continues from its last one. Jobs run one after another in this process, or `launch.jobs` at
a time in processes of their own; `--only NAME` runs one of them (one host each).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from opd_jax.config import DataSection, TrainConfig, save_config, to_plain
from opd_jax.config.opd_pipeline import ExpertsConfig
from opd_jax.data import source_domains
from opd_jax.errors import OpdJaxError
from opd_jax.models import save_model
from opd_jax.train import (
    build_model,
    checkpoint_steps,
    held_out_evaluator,
    lock,
    read_metrics,
    run_status,
    train,
    warm_start,
    write_json,
)

BASE = "base"


class ExpertsError(OpdJaxError, RuntimeError):
    """A base or expert that could not be trained; names it and where its log is."""


def base_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / BASE


def expert_dir(run_dir: str | Path, name: str) -> Path:
    return Path(run_dir) / "experts" / name


def _train_config(config: ExpertsConfig, changes: dict[str, Any]) -> TrainConfig:
    """The expert template with `changes` ({"dotted.key": value}) applied, validated again."""
    plain = to_plain(config.expert)
    for key, value in changes.items():
        *parents, last = key.split(".")
        node = plain
        for part in parents:
            node = node[part]
        node[last] = value
    return TrainConfig.model_validate(plain)


def held_out_region(data: DataSection) -> dict[str, float]:
    """Which problems a run held out (opd_jax.data.splits): a merge evaluates on the same region."""
    return {"seed": data.seed, "share": data.held_out_share}


def base_train_config(config: ExpertsConfig) -> TrainConfig:
    """The base's warm start: the base model, its sft, on every expert's sources mixed."""
    sources = [to_plain(s) for specs in config.experts.values() for s in specs]
    return _train_config(config, {"model": to_plain(config.base.model), "sft": to_plain(config.base.sft),
                                  "data.train": sources, "logging.run_dir": str(base_dir(config.run_dir))})


def expert_train_config(config: ExpertsConfig, name: str) -> TrainConfig:
    """Expert `name`'s RL run: from the base's model, on its own sources, in its own directory."""
    return _train_config(config, {
        "model.path": str((base_dir(config.run_dir) / "model").resolve()), "model.fresh": None,
        "data.train": [to_plain(s) for s in config.experts[name]],
        "logging.run_dir": str(expert_dir(config.run_dir, name)), "checkpoint.export_hf": True})


def build_base(config: ExpertsConfig) -> dict[str, Any]:
    """The base model and its held-out accuracy on every domain (kept if already built)."""
    directory = base_dir(config.run_dir)
    summary_path = directory / "base.json"
    if summary_path.exists():
        return json.loads(summary_path.read_text())
    with contextlib.closing(lock(directory, "experts")):  # one builder at a time
        if summary_path.exists():  # built while this process waited for the lock
            return json.loads(summary_path.read_text())
        return _build_base(config, directory, summary_path)


def _build_base(config: ExpertsConfig, directory: Path, summary_path: Path) -> dict[str, Any]:
    cfg = base_train_config(config)
    began = time.perf_counter()
    policy, tokenizer = build_model(cfg.model)
    if cfg.sft.steps:
        policy = warm_start(policy, tokenizer, cfg, directory)
    model_dir = save_model(policy, directory / "model", tokenizer)
    trained = time.perf_counter() - began
    evaluator = held_out_evaluator(tokenizer, policy, cfg.rollout, cfg.data)
    try:
        accuracy = evaluator(policy)
    finally:
        evaluator.close()
    summary = {"model": str(model_dir.resolve()), "eval": accuracy, "sft_steps": cfg.sft.steps,
               "wall_time_s": trained, "held_out": held_out_region(cfg.data)}
    write_json(summary_path, summary)
    return summary


def run_expert(config: ExpertsConfig, name: str) -> dict[str, Any]:
    """Train expert `name` from the base (or continue it); its summary."""
    if name not in config.experts:
        raise ExpertsError(f"no expert {name!r}; the config has: {', '.join(config.experts)}")
    if not (base_dir(config.run_dir) / "base.json").exists():
        raise ExpertsError(f"expert {name!r} needs the base, which is not built yet: run "
                           f"`opd-jax experts CONFIG --only base` first")
    directory = expert_dir(config.run_dir, name)
    summary_path = directory / "expert.json"
    if summary_path.exists():
        return json.loads(summary_path.read_text())
    cfg = expert_train_config(config, name)
    done = checkpoint_steps(directory)
    resume = bool(done)
    began = time.perf_counter()
    try:
        if run_status(directory) != "finished":  # else trained and exported already: only its summary is missing
            train(cfg, resume=resume)
    except OpdJaxError as e:  # any named problem of its run (data, model, run directory, a failed step)
        raise ExpertsError(f"expert {name!r}: {e}") from None
    rows = read_metrics(directory / "metrics.jsonl")
    evals = [r for r in rows if "eval/accuracy" in r]
    domains = sorted(set().union(*(source_domains(s) for s in config.experts[name])))
    # a JSONL source without an eval file has no held-out accuracy
    accuracy = lambda row: {d: row[f"eval/{d}/accuracy"] for d in domains if f"eval/{d}/accuracy" in row}  # noqa: E731
    summary = {"name": name, "model": str((directory / "hf_policy").resolve()), "domains": domains,
               "sources": [to_plain(s) for s in config.experts[name]], "steps": cfg.steps,
               "eval": accuracy(evals[-1]) if evals else {},
               "eval_at_start": accuracy(evals[0]) if evals and evals[0]["step"] == 0 else None,
               "wall_time_s": time.perf_counter() - began, "resumed": resume, "held_out": held_out_region(cfg.data)}
    write_json(summary_path, summary)
    return summary


def _job_env(slot: int, config: ExpertsConfig) -> dict[str, str]:
    env = dict(os.environ)
    per = config.launch.devices_per_job
    if per is not None:
        env[config.launch.device_env] = ",".join(str(d) for d in range(slot * per, (slot + 1) * per))
    return env


def _run_jobs(config: ExpertsConfig, config_path: Path, names: list[str]) -> None:
    """Each name as `opd-jax experts CONFIG --only NAME` in its own process, launch.jobs at once;
    every job runs to its end, then the failed ones are named with their logs."""
    waiting, running, failed = list(names), {}, []
    while waiting or running:
        free = [s for s in range(config.launch.jobs) if s not in running]
        while waiting and free:
            name, slot = waiting.pop(0), free.pop(0)
            log_path = (base_dir(config.run_dir) if name == BASE else expert_dir(config.run_dir, name)) / "job.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log = log_path.open("w")
            process = subprocess.Popen([sys.executable, "-m", "opd_jax.cli", "experts", str(config_path), "--only",
                                        name], stdout=log, stderr=subprocess.STDOUT, env=_job_env(slot, config))
            running[slot] = (name, process, log, log_path)
        for slot, (name, process, log, log_path) in list(running.items()):
            if process.poll() is not None:
                log.close()
                del running[slot]
                if process.returncode != 0:
                    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
                    failed.append(f"{name} (exit {process.returncode}, log {log_path}):\n{tail}")
        time.sleep(0.2)
    if failed:
        raise ExpertsError("these jobs failed:\n" + "\n".join(failed))


def run_experts(config: ExpertsConfig, *, only: str | None = None) -> Path:
    """Build the base and train every expert (or only `only`: 'base' or an expert's name);
    returns the run directory, with experts.json written once all are done."""
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if only == BASE:
        build_base(config)
        return run_dir
    if only is not None:
        run_expert(config, only)
        return run_dir
    began = time.perf_counter()
    if config.launch.jobs == 1:
        build_base(config)
        failed = []
        for name in config.experts:  # a failed expert does not stop the others
            try:
                run_expert(config, name)
            except ExpertsError as e:
                failed.append(str(e))
        if failed:
            raise ExpertsError("these experts failed (the others are kept):\n" + "\n".join(failed))
    else:  # the jobs own the devices: this process never touches them
        config_path = run_dir / "experts_config.yaml"
        save_config(config, config_path)
        if not (base_dir(run_dir) / "base.json").exists():
            _run_jobs(config, config_path, [BASE])
        _run_jobs(config, config_path, [n for n in config.experts
                                        if not (expert_dir(run_dir, n) / "expert.json").exists()])
    manifest = {"base": json.loads((base_dir(run_dir) / "base.json").read_text()),
                "experts": {n: json.loads((expert_dir(run_dir, n) / "expert.json").read_text())
                            for n in config.experts},
                "wall_time_s": time.perf_counter() - began}
    write_json(run_dir / "experts.json", manifest)
    return run_dir

