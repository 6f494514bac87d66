"""Sweeps: the aggregate against numbers worked out by hand (means, t intervals, paired
differences, collapse steps), bad sweeps refused before any run, and a sweep interrupted mid-way
that resumes without rerunning what finished and writes the same sweep.json."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from train_loop_settings import TINY
from xla_env import xla_flags

from opd_jax.config import ConfigError, dump_config, load_config
from opd_jax.config.sweep import CollapseSection
from opd_jax.sweep import Sweep, SweepError, aggregate, run_sweep
from opd_jax.sweep.stats import collapse

T_975_DF2 = 4.302652729911275  # Student's t, 97.5% quantile, 2 degrees of freedom (tables)


def fake_run(run_dir: Path, evals: dict[int, float], extra: dict[int, dict[str, float]] | None = None,
             steps: int = 2) -> None:
    """A finished run directory of `steps` steps whose metrics.jsonl holds these evaluations (and
    training rows)."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"steps: {steps}\n")
    rows = {s: {"step": s} for s in sorted({*evals, *(extra or {})})}
    for s, v in evals.items():
        rows[s]["eval/accuracy"] = v
    for s, metrics in (extra or {}).items():
        rows[s].update(metrics)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows.values()))
    (run_dir / "run.json").write_text(json.dumps({"command": "train", "status": "finished"}))


def write_sweep(tmp_path: Path, **spec) -> Path:
    base = tmp_path / "base.yaml"
    base.write_text(dump_config(load_config(None, TINY)))
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": "base.yaml", **spec}))
    return path


def test_the_aggregate_equals_hand_computed_intervals_and_paired_differences(tmp_path):
    path = write_sweep(tmp_path, cells=[{"name": "a"}, {"name": "b", "overrides": {"steps": 3}}], seeds=3,
                       metrics=["policy/entropy"], compare=[["a", "b"]])
    sweep = Sweep(path, tmp_path / "out")
    finals = {"a": [0.5, 0.7, 0.6], "b": [0.4, 0.5, 0.5]}
    for cell, values in finals.items():
        for seed, v in enumerate(values):
            fake_run(sweep.run_dir(cell, seed), {0: 0.3, 10: 0.2 + seed * 0.1, 20: v},
                     {20: {"policy/entropy": 1.0 + seed}}, steps=sweep.steps[cell, seed])
    result = aggregate(sweep)
    final = result["cells"]["a"]["summary"]["final"]
    half = T_975_DF2 * 0.1 / math.sqrt(3)  # sd of [0.5, 0.7, 0.6] is 0.1
    assert final["n"] == 3 and math.isclose(final["mean"], 0.6)
    assert math.isclose(final["low"], 0.6 - half, rel_tol=1e-9) and math.isclose(final["high"], 0.6 + half, rel_tol=1e-9)
    gain = result["cells"]["a"]["summary"]["gain"]
    assert math.isclose(gain["mean"], 0.3, rel_tol=1e-9)  # final − first, first = 0.3 everywhere
    best = result["cells"]["b"]["summary"]["best"]  # per seed max(0.3, 0.2 + 0.1 s, final): 0.4, 0.5, 0.5
    assert math.isclose(best["mean"], 1.4 / 3, rel_tol=1e-9)
    entropy = result["cells"]["a"]["summary"]["policy/entropy"]
    assert math.isclose(entropy["mean"], 2.0) and math.isclose(entropy["high"] - 2.0, T_975_DF2 * 1.0 / math.sqrt(3))
    (diff,) = result["comparisons"]  # differences 0.1, 0.2, 0.1: mean 0.1333, sd 0.0577, t = 4 on 2 df
    assert diff["seeds"] == [0, 1, 2] and math.isclose(diff["mean"], 0.4 / 3, rel_tol=1e-9)
    sd = math.sqrt(((0.1 - 0.4 / 3) ** 2 * 2 + (0.2 - 0.4 / 3) ** 2) / 2)
    assert math.isclose(diff["high"] - diff["mean"], T_975_DF2 * sd / math.sqrt(3), rel_tol=1e-9)
    # two-sided p of t = 4 with 2 df: the t CDF with 2 df is 1/2 + t / (2 sqrt(2 + t^2))
    assert math.isclose(diff["p_value"], 2 * (0.5 - 4 / (2 * math.sqrt(18))), rel_tol=1e-9)
    step, mean, low, high = result["cells"]["a"]["curve"][0]  # every seed 0.3 at step 0: a band of width 0
    assert step == 0 and math.isclose(mean, 0.3) and math.isclose(low, 0.3) and math.isclose(high, 0.3)
    md = (sweep.out / "sweep.md").read_text()
    assert "| a − b | 3 | 0.133 [" in md and (sweep.out / "curves.png").stat().st_size > 0
    assert json.loads((sweep.out / "sweep.json").read_text())["cells"]["b"]["summary"]["final"]["n"] == 3


def test_the_declared_primary_outcome_is_tested_as_declared_and_reported_first(tmp_path):
    """last_mean over 2 evaluations, a one-sided paired t-test and Holm's correction over two
    contrasts; a non-inferiority test; Fisher's exact test of collapse counts; identical cells
    give p = 1, not NaN; sweep.md opens with the primary outcome and calls the rest exploratory."""
    cells = [{"name": n} for n in ("a", "b", "c")]
    primary = {"outcome": "last_mean", "last": 2, "contrasts": [["a", "b"], ["c", "b"]], "alternative": "greater",
               "correction": "holm"}
    path = write_sweep(tmp_path, cells=cells, seeds=3, primary=primary, compare=[["b", "b"]])
    sweep = Sweep(path, tmp_path / "out")
    last = {"a": [(0.5, 0.7), (0.6, 0.8), (0.7, 0.7)], "b": [(0.5, 0.5), (0.5, 0.6), (0.6, 0.6)],
            "c": [(0.5, 0.5), (0.5, 0.6), (0.6, 0.6)]}
    for cell, values in last.items():
        for seed, (x, y) in enumerate(values):
            fake_run(sweep.run_dir(cell, seed), {0: 0.3, 10: x, 20: y}, steps=sweep.steps[cell, seed])
    result = aggregate(sweep)
    a_b, c_b = result["primary"]["results"]
    # a − b per seed: means of the last two, 0.6 − 0.5, 0.7 − 0.55, 0.7 − 0.6 = 0.1, 0.15, 0.1
    d = [0.1, 0.15, 0.1]
    mean, sd = sum(d) / 3, math.sqrt(sum((x - sum(d) / 3) ** 2 for x in d) / 2)
    t = mean / (sd / math.sqrt(3))
    p_one_sided = 0.5 - t / (2 * math.sqrt(2 + t * t))  # 1 − CDF of Student's t with 2 df
    assert math.isclose(a_b["mean"], mean, rel_tol=1e-9) and math.isclose(a_b["p_value"], p_one_sided, rel_tol=1e-9)
    assert c_b["p_value"] == 1.0 and c_b["mean"] == 0.0  # identical cells: no difference, not NaN
    # Holm: the smaller p × 2, then the larger × 1 (never below the one before)
    assert math.isclose(a_b["p_corrected"], 2 * p_one_sided, rel_tol=1e-9) and c_b["p_corrected"] == 1.0
    assert a_b["rejects"] == (2 * p_one_sided < 0.05) and not c_b["rejects"]
    assert result["comparisons"][0]["p_value"] == 1.0
    md = (sweep.out / "sweep.md").read_text()
    assert md.index("## Primary outcome (declared before the runs)") < md.index("## Exploratory") < md.index("| cell |")
    assert "the mean eval/accuracy of the last 2 evaluations" in md and "holm correction over 2 contrast(s)" in md
    assert json.loads((sweep.out / "sweep.json").read_text())["primary"]["declared"]["test"] == "paired_t"

    # non-inferiority of c against a with margin 0.2: c − a = −0.1, −0.15, −0.1, so c − a + 0.2 > 0
    path = write_sweep(tmp_path, cells=cells, seeds=3, primary={"outcome": "last_mean", "last": 2, "contrasts": [["c", "a"]],
                                                                "test": "non_inferiority", "margin": 0.2})
    (result,) = aggregate(Sweep(path, tmp_path / "out"))["primary"]["results"]
    shifted = [0.2 - x for x in d]
    m2, s2 = sum(shifted) / 3, math.sqrt(sum((x - sum(shifted) / 3) ** 2 for x in shifted) / 2)
    t2 = m2 / (s2 / math.sqrt(3))
    assert math.isclose(result["p_value"], 0.5 - t2 / (2 * math.sqrt(2 + t2 * t2)), rel_tol=1e-9)
    assert math.isclose(result["mean"], -mean, rel_tol=1e-9)

    # collapse counts: a's seed 0 fell 0.1 below its start; Fisher's exact, 1/3 vs 0/3 two-sided = 1
    rows = {0: 0.5, 10: 0.3, 20: 0.3}
    for seed in range(3):
        for cell in ("a", "b", "c"):
            (sweep.run_dir(cell, seed) / "metrics.jsonl").unlink()
            (sweep.run_dir(cell, seed) / "metrics.jsonl").write_text("".join(
                json.dumps({"step": s, "eval/accuracy": v if cell == "a" else 0.5}) + "\n"
                for s, v in rows.items()) + json.dumps({"step": sweep.steps[cell, seed]}) + "\n")
    path = write_sweep(tmp_path, cells=cells, seeds=3, primary={"outcome": "collapsed", "contrasts": [["a", "b"]],
                                                                "test": "fisher_exact", "alternative": "greater"})
    (result,) = aggregate(Sweep(path, tmp_path / "out"))["primary"]["results"]
    # 3/3 against 0/3, one-sided: the one table as extreme of C(3,3)C(3,0)/C(6,3) = 1/20
    assert result["a_count"] == "3/3" and result["b_count"] == "0/3" and math.isclose(result["p_value"], 1 / 20)


def test_collapse_is_found_with_its_first_step_per_kind():
    rule = CollapseSection(eval_drop=0.1, grad_norm_factor=10.0, entropy_floor=0.05)
    rows = [{"step": 0, "eval/accuracy": 0.5}]
    rows += [{"step": s, "policy/grad_norm": 1.0 + 0.1 * s, "policy/entropy": 1.0, "policy/skipped_nonfinite": 0.0}
             for s in range(1, 13)]
    rows[7]["policy/grad_norm"] = 30.0  # step 7: 30 > 10 × median(1.1 .. 1.5) = 13
    rows[9]["policy/entropy"] = 0.01  # step 9
    rows[11]["critic/skipped_nonfinite"] = 1.0  # step 11
    rows += [{"step": 10, "eval/accuracy": 0.45}, {"step": 12, "eval/accuracy": 0.35}]  # 0.45 is within the margin
    assert collapse(rows, "eval/accuracy", rule) == {"eval_drop": 12, "grad_blowup": 7, "nonfinite": 11, "entropy": 9,
                                                      "any": 7}
    calm = [r for r in rows if r["step"] < 7]
    assert collapse(calm, "eval/accuracy", rule)["any"] is None
    # a run that learns: its gradient norm grows 30-fold over 300 steps, never 10-fold in 20 steps
    growing = [{"step": s, "policy/grad_norm": 0.1 + 0.01 * s} for s in range(1, 301)]
    assert collapse(growing, "eval/accuracy", rule)["grad_blowup"] is None


@pytest.mark.parametrize("spec, message", [
    ({"grid": {"algorithm.ppo.surrogate.eps_hgh": [0.2]}, "seeds": 2}, "did you mean algorithm.ppo.surrogate.eps_high"),
    ({"grid": {}, "seeds": 2}, "the sweep has no cells"),
    ({"grid": {"steps": []}, "seeds": 2}, "grid key steps has no values"),
    ({"grid": {"steps": [2]}, "seeds": 1}, "a confidence interval needs at least 2"),
    ({"cells": [{"name": "a"}], "seeds": 2, "compare": [["a", "z"]]}, "no cell named 'z'"),
    ({"cells": [{"name": "a"}], "seeds": 2, "primary": {"outcome": "final", "contrasts": [["a", "y"]]}},
     "primary.contrasts: no cell named 'y'"),
    ({"cells": [{"name": "a"}], "seeds": 2, "primary": {"outcome": "final", "contrasts": [["a", "a"]],
                                                        "test": "fisher_exact"}}, "fisher_exact tests only 'collapsed'"),
    ({"cells": [{"name": "a"}], "seeds": 2, "primary": {"outcome": "final", "contrasts": [["a", "a"]],
                                                        "test": "non_inferiority"}}, "needs a margin > 0"),
    ({"grid": {"steps": [0]}, "seeds": 2}, "cell steps=0"),
    ({"axes": {"engine": {}}, "seeds": 2}, "axis engine has no labels"),
    ({"axes": {"engine": {"bf16": {"rollout.dtyp": "bfloat16"}}}, "seeds": 2},
     "(?s)cell engine=bf16: .*did you mean rollout.dtype"),
    # the sweep file's own overrides are named as such, not blamed on the base config
    ({"overrides": {"stepz": 3}, "grid": {"steps": [2]}, "seeds": 2},
     r"sweep.yaml: overrides: override 'stepz=3': stepz: unknown key \(did you mean steps\?\)"),
    # a bad grid value is named, not hidden behind the comparison that names its cell
    ({"grid": {"algorithm.ppo.surrogate.mismatch.kind": ["icepop", "tiss"]}, "seeds": 2,
      "compare": [["kind=icepop", "kind=tis"]]}, r"cell kind=tiss: .*unknown mismatch correction 'tiss'"),
])
def test_a_bad_sweep_is_refused_before_any_run(tmp_path, spec, message):
    path = write_sweep(tmp_path, **spec)
    with pytest.raises((SweepError, ConfigError), match=message):
        Sweep(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_one_sweep_at_a_time_in_a_directory_and_nothing_to_aggregate_is_said(tmp_path):
    """A second `opd-jax sweep` into the directory of a running one is refused naming it (it would
    race the first for the same runs); --aggregate-only on a directory without runs creates nothing;
    --in-process with more than one job at a time is refused."""
    from typer.testing import CliRunner

    from opd_jax.cli import app
    from opd_jax.run_files import lock
    path = write_sweep(tmp_path, grid={"steps": [2]}, seeds=2)
    cli = lambda *a: CliRunner().invoke(app, ["sweep", str(path), *map(str, a)], env={"COLUMNS": "1000"})  # noqa: E731
    out = tmp_path / "out"
    holder = lock(out, "sweep")  # the first sweep (flock: per open file, so this process too)
    try:
        result = cli("--out", out)
        assert result.exit_code == 2 and f"{out} is in use by `opd-jax sweep` (pid " in result.output, result.output
        assert not (out / "steps=2").exists()
    finally:
        holder.close()
    result = cli("--out", tmp_path / "missing", "--aggregate-only")
    assert result.exit_code == 2 and "does not exist: nothing to aggregate" in result.output, result.output
    assert not (tmp_path / "missing").exists()
    result = cli("--out", tmp_path / "here", "--in-process", "--jobs", "2")
    assert result.exit_code == 2 and result.output.startswith("error: --in-process runs one run at a time, in this "
                                                              "process: drop --jobs 2"), result.output
    assert not (tmp_path / "here").exists()


SMALL = ["steps=3", "sft.steps=0", "checkpoint.every=1", "logging.eval_every=3", "data.eval_prompts_per_domain=8",
         "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]


def test_an_interrupted_sweep_resumes_without_rerunning_finished_runs_and_gives_the_same_result(tmp_path, monkeypatch):
    """One cell, three seeds, one run at a time: interrupted (SIGINT to the sweep and its run) once
    the second seed's run has a checkpoint: the third, still queued, never starts. Run again: the
    first seed's run is kept as it was (one attempt), the second resumes from its checkpoint, the
    third runs, and sweep.json equals that of an uninterrupted sweep of the same file run with
    `--in-process` (every run in the sweep's one process): the same commands give the same runs."""
    path = write_sweep(tmp_path, cells=[{"name": "a"}], seeds=3,
                       overrides=dict(item.split("=", 1) for item in SMALL), metrics=["policy/entropy"])
    monkeypatch.setenv("XLA_FLAGS", xla_flags(1))  # every run: one device
    env = dict(os.environ)
    # a process of one device, as each of the other sweep's runs is (this one has eight)
    done = subprocess.run([sys.executable, "-m", "opd_jax.cli", "sweep", str(path), "--out", str(tmp_path / "whole"),
                           "--in-process"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "opd-jax train: new run in" in (tmp_path / "whole" / "a" / "seed0.log").read_text()  # its output: in its log
    whole = json.loads((tmp_path / "whole" / "sweep.json").read_text())
    part = tmp_path / "part"
    process = subprocess.Popen([sys.executable, "-m", "opd_jax.cli", "sweep", str(path), "--out", str(part)],
                               env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while not any((part / "a" / "seed1" / "checkpoints").glob("*")) and time.time() < deadline:
        assert process.poll() is None, process.stdout.read().decode()
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGINT)
    output = process.communicate(timeout=120)[0].decode()
    assert process.returncode != 0, output
    assert (f"stopped: interrupted; run `opd-jax sweep {path} --out {part}` again (its finished runs are kept and "
            f"interrupted ones resume)") in output, output
    assert json.loads((part / "a" / "seed1" / "run.json").read_text())["status"] != "finished", output
    assert not (part / "a" / "seed2").exists(), output
    run_sweep(Sweep(path, part), echo=lambda _: None)
    resumed = json.loads((part / "sweep.json").read_text())
    attempts = [json.loads((part / "a" / f"seed{s}" / "run.json").read_text())["attempts"] for s in (0, 1, 2)]
    assert [len(a) for a in attempts] == [1, 2, 1] and attempts[1][1]["resumed_from"] is not None
    assert json.dumps(untimed(resumed), sort_keys=True) == json.dumps(untimed(whole), sort_keys=True)
    assert whole["cells"]["a"]["summary"]["final"]["n"] == 3
    walls = [r["wall_s"] for r in whole["cells"]["a"]["runs"].values()]
    assert all(0 < w < 600 for w in walls) and whole["cells"]["a"]["summary"]["wall_s"]["n"] == 3
    assert all(0 < r["steps_s"] < r["wall_s"] for r in whole["cells"]["a"]["runs"].values())


def untimed(result: dict) -> dict:
    """A sweep's result without its wall times (what this machine took, not what the runs found)."""
    result = json.loads(json.dumps(result))
    for cell in result["cells"].values():
        for key in ("wall_s", "steps_s"):
            cell["summary"].pop(key)
            for run in cell["runs"].values():
                run.pop(key)
    return result


def test_axes_name_their_cells_and_a_shared_warm_start_is_one_per_distinct_warm_start(tmp_path):
    """A grid key and a named axis multiply; each label's overrides land together. Cells that
    differ only in RL settings share a seed's warm start; a different model needs its own."""
    path = write_sweep(tmp_path, grid={"algorithm.ppo.surrogate.eps_high": [0.2, 0.28]}, seeds=[3, 4],
                       axes={"engine": {"bf16": {"rollout.dtype": "bfloat16"},
                                        "wide": {"rollout.dtype": "bfloat16", "model.fresh.hidden_size": 128}}},
                       warm_start="shared", overrides={"sft.steps": 2})
    sweep = Sweep(path, tmp_path / "out")
    assert [name for name, _ in sweep.cells] == ["eps_high=0.2,engine=bf16", "eps_high=0.2,engine=wide",
                                                 "eps_high=0.28,engine=bf16", "eps_high=0.28,engine=wide"]
    assert sweep.cells[1][1] == {"algorithm.ppo.surrogate.eps_high": 0.2, "rollout.dtype": "bfloat16",
                                 "model.fresh.hidden_size": 128}
    warm = sweep.warm_starts
    assert warm["eps_high=0.2,engine=bf16", 3] == warm["eps_high=0.28,engine=bf16", 3]
    assert warm["eps_high=0.2,engine=bf16", 3] != warm["eps_high=0.2,engine=bf16", 4]  # seeds differ
    assert warm["eps_high=0.2,engine=bf16", 3] != warm["eps_high=0.2,engine=wide", 3]  # models differ
    assert len(set(warm.values())) == 4
    command = sweep.command(*sweep.cells[0], 3)
    start = command.index("model.fresh=null")  # after the seed's model.fresh.seed, so the warm start's model wins
    assert command.index("model.fresh.seed=3") < start
    assert command[start:start + 3] == ["model.fresh=null", f"model.path={warm['eps_high=0.2,engine=bf16', 3] / 'sft_policy'}",
                                        "sft.steps=0"]
    (tmp_path / "b").mkdir()
    per_run = Sweep(write_sweep(tmp_path / "b", cells=[{"name": "a"}], seeds=2, overrides={"sft.steps": 2}), tmp_path / "o")
    assert per_run.warm_starts == {} and "sft.steps=0" not in per_run.command("a", {}, 0)


def test_a_run_from_the_shared_warm_start_trains_as_one_that_warms_itself(tmp_path, monkeypatch):
    """The shared warm start (`opd-jax sft`, once per seed) and a run that warms itself up end in
    the same policy: the sweep's run reaches the held-out accuracies and the rewards of the same
    run made in-process with its own warm start."""
    from opd_jax.train import read_metrics

    monkeypatch.setenv("XLA_FLAGS", xla_flags(1))
    small = [*(s for s in SMALL if not s.startswith("sft.steps")), "sft.steps=3", "logging.eval_every=1"]
    path = write_sweep(tmp_path, cells=[{"name": "a"}], seeds=[0, 1], warm_start="shared",
                       overrides=dict(item.split("=", 1) for item in small))
    sweep = Sweep(path, tmp_path / "out")
    run_sweep(sweep, jobs=2, echo=lambda _: None)
    warm = sorted((tmp_path / "out" / "_warm_start").glob("*/sft_policy"))
    assert len(warm) == 2
    for seed in (0, 1):
        warm = sweep.warm_starts["a", seed] / "sft_policy"
        assert load_config(sweep.run_dir("a", seed) / "config.yaml").model.path == str(warm)
    reference = tmp_path / "reference"  # as the sweep runs it, in a process of one device
    subprocess.run([sys.executable, "-m", "opd_jax.cli", "train", str(sweep.base), *sweep.overrides({}, 1),
                    f"logging.run_dir={reference}"], env=dict(os.environ), check=True, capture_output=True)
    ours, theirs = (read_metrics(d / "metrics.jsonl") for d in (sweep.run_dir("a", 1), reference))
    assert [r.get("eval/accuracy") for r in ours] == [r.get("eval/accuracy") for r in theirs]
    assert [r.get("reward_mean") for r in ours] == [r.get("reward_mean") for r in theirs]
    np_close = [abs(a["policy/loss"] - b["policy/loss"]) < 1e-4 for a, b in zip(ours, theirs) if "policy/loss" in a]
    assert np_close and all(np_close)


def test_a_reduced_copy_keeps_the_named_values_and_the_comparisons_among_them(tmp_path):
    """Experiment 1's sweep file cut to two labels of each axis, two seeds and two steps: four
    cells plus the named f32 control, the overrides on top, only the comparisons whose cells are
    left; a key to keep that the sweep does not have is refused."""
    from opd_jax.sweep import reduced

    source = Path(__file__).parents[1] / "configs" / "sweeps" / "mismatch_sources.yaml"
    small = reduced(source, tmp_path / "small", seeds=[7, 8], overrides={"steps": 2},
                    keep={"source": ["bf16", "int4"], "correction": ["none", "icepop"]})
    assert [name for name, _ in small.cells] == ["source=bf16,correction=none", "source=bf16,correction=icepop",
                                                 "source=int4,correction=none", "source=int4,correction=icepop",
                                                 "source=f32,correction=none"]
    assert small.config.seed_list == [7, 8] and small.config.overrides["steps"] == 2
    assert small.config.overrides["algorithm.policy_optimizer.learning_rate"] == 5e-4  # the original's stay
    assert small.config.compare == [("source=bf16,correction=icepop", "source=bf16,correction=none"),
                                    ("source=int4,correction=icepop", "source=int4,correction=none"),
                                    ("source=int4,correction=none", "source=f32,correction=none")]
    assert small.out == (tmp_path / "small").resolve() and small.base == source.parent.parent / "quickstart.yaml"
    with pytest.raises(SweepError, match="no grid key or axis 'engine'"):
        reduced(source, tmp_path / "other", keep={"engine": ["bf16"]})


def test_raising_steps_resumes_the_finished_runs_and_leaves_them_out_until_they_have_trained(tmp_path):
    """A finished run of 20 steps in a sweep that now asks for 30 is resumed (`--resume`), and its
    figures wait for the longer run; a run already at 30 stays finished."""
    path = write_sweep(tmp_path, cells=[{"name": "a"}], seeds=2, overrides={"steps": 30})
    sweep = Sweep(path, tmp_path / "out")
    fake_run(sweep.run_dir("a", 0), {0: 0.3, 20: 0.5}, steps=20)
    fake_run(sweep.run_dir("a", 1), {0: 0.3, 30: 0.6}, steps=30)
    (sweep.run_dir("a", 0) / "checkpoints" / "20").mkdir(parents=True)
    command = sweep.command("a", {}, 0)
    assert command is not None and command[-1] == "--resume" and "steps=30" in command
    assert sweep.command("a", {}, 1) is None
    assert list(aggregate(sweep)["cells"]["a"]["runs"]) == ["1"]


def test_a_merge_sweep_runs_opd_jax_merge_with_the_merge_seed_keys(tmp_path):
    """command: merge resolves every cell against the merge config (a misspelt key is named with
    its cell) and each run is an `opd-jax merge` whose seed keys are the merge's own."""
    base = tmp_path / "merge.yaml"
    base.write_text(yaml.safe_dump({"experts_dir": str(tmp_path / "experts"), "steps": 5}))
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"command": "merge", "base": "merge.yaml", "seeds": [0, 1],
                                    "grid": {"optimizer.learning_rate": [5e-4, 1e-3]}}))
    sweep = Sweep(path, tmp_path / "out")
    command = sweep.command(*sweep.cells[1], 1)
    assert command[2:5] == ["opd_jax.cli", "merge", str(base)]
    assert "optimizer.learning_rate=0.001" in command and "seed=1" in command and "data.seed=1" in command
    assert not any(c.startswith("model.fresh.seed") for c in command)
    # a run killed before its first checkpoint (orbax left only its log) starts over, not --resume
    (sweep.run_dir(*sweep.cells[1][:1], 1) / "checkpoints").mkdir(parents=True)
    (sweep.run_dir(*sweep.cells[1][:1], 1) / "checkpoints" / "orbax.log").touch()
    assert "--resume" not in sweep.command(*sweep.cells[1], 1)
    (sweep.run_dir(*sweep.cells[1][:1], 1) / "checkpoints" / "150").mkdir()
    assert sweep.command(*sweep.cells[1], 1)[-1] == "--resume"
    path.write_text(yaml.safe_dump({"command": "merge", "base": "merge.yaml", "seeds": 2,
                                    "grid": {"optimizer.learning_rat": [1e-3]}}))
    with pytest.raises(SweepError, match="(?s)cell learning_rat=0.001: .*did you mean optimizer.learning_rate"):
        Sweep(path, tmp_path / "out")
    path.write_text(yaml.safe_dump({"command": "merge", "base": "merge.yaml", "seeds": 2, "warm_start": "shared",
                                    "grid": {"steps": [2]}}))
    with pytest.raises(ConfigError, match="warm_start 'shared' is for command 'train'"):
        Sweep(path, tmp_path / "out")
