"""`opd-jax recipe` at test size (three domains), as a user runs it, in processes of its own:
killed in every phase (the base's warm start, an expert's RL, the merge's steps, the merge's
export) and run again each time, it ends with the report of an uninterrupted run; bad input is
named in one line, and an expert that fails leaves the others kept and the merge refused, naming
the missing expert."""

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from merge_settings import BASE_AND_EXPERTS
from xla_env import xla_flags

from opd_jax.config import RecipeConfig, load_config
from opd_jax.train import checkpoint_steps

TINY = [*BASE_AND_EXPERTS, "base.sft.steps=6", "expert.steps=3", "expert.logging.eval_every=3", "expert.checkpoint.every=1",
        "merge.steps=4", "merge.rollout.max_new_tokens=4", "merge.data.prompts_per_step=6",
        "merge.data.eval_prompts_per_domain=8", "merge.logging.eval_every=4", "merge.logging.progress_bar=false",
        "merge.logging.tensorboard=false", "merge.logging.plot=false", "merge.checkpoint.every=1",
        "merge.opd.loss=full", "merge.baselines.validation_prompts_per_domain=4",
        "merge.baselines.task_arithmetic_scales=[0.5, 1.0]",
        "domains={addition: [{builtin: addition, params: {digits: 1}}], max: [{builtin: max, params: {hi: 9}}], "
        "parity: [{builtin: parity, params: {max_len: 5}}]}"]  # 56 problems: 14 held out
# one device, full precision: every process of a comparison computes the same numbers
ENV = {**os.environ, "XLA_FLAGS": xla_flags(1), "JAX_PLATFORMS": "cpu",
       "JAX_DEFAULT_MATMUL_PRECISION": "highest"}


def command(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "opd_jax.cli", "recipe", os.devnull, *TINY, f"run_dir={run_dir}", *extra]


def run(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(command(run_dir, *extra), env=ENV, capture_output=True, text=True, timeout=900)


def kill_when(run_dir: Path, reached) -> bool:
    """Start the recipe and SIGKILL it as soon as `reached()`; False if it ended first."""
    process = subprocess.Popen(command(run_dir), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while process.poll() is None:
            if reached():
                process.kill()
                process.wait()
                return True
            time.sleep(0.05)
        return False
    finally:
        if process.poll() is None:
            process.kill()


def weights(model_dir: Path) -> str:
    return hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()


def comparable(report: dict) -> dict:
    """What the report says of the models (not wall times or paths, which differ run to run)."""
    keys = ("domains", "mean", "student_over_expert", "task_arithmetic_scale", "domains_kept", "domains_below")
    return {k: report[k] for k in keys if k in report}


def test_killed_in_every_phase_the_recipe_ends_as_an_uninterrupted_one(tmp_path):
    straight = tmp_path / "straight"
    done = run(straight)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for phase in ("[1/3] experts: base and 3 experts", "[2/3] merge: ", "[3/3] report: "):
        assert phase in done.stdout + done.stderr

    killed = tmp_path / "killed"
    experts, merge_dir = killed / "experts", killed / "merge"
    kills = {  # each phase, in turn: the run is killed there, then started again
        "base warm start": lambda: (experts / "base" / "warm_start" / "metrics.jsonl").exists(),
        "an expert's RL": lambda: bool(checkpoint_steps(experts / "experts" / "max")),
        "the merge's steps": lambda: bool(checkpoint_steps(merge_dir)),
        "the merge's export": lambda: (merge_dir / "student").exists(),
    }
    for where, reached in kills.items():
        assert kill_when(killed, reached), f"the recipe ended before it was killed in {where}"
    done = run(killed)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[1/3] experts: base and 3 experts in" in done.stdout + done.stderr

    a, b = (json.loads((d / "report.json").read_text()) for d in (straight, killed))
    assert set(a["domains"]) == {"addition", "max", "parity"}
    assert comparable(b) == comparable(a)
    ledger = json.loads((killed / "recipe.json").read_text())
    assert ledger["attempts"] == 5 and ledger["done"] == ["experts", "merge", "report"]
    text = (killed / "report.md").read_text()
    assert "| **mean** |" in text and re.search(r"keeps at least 95% of its expert on \d of \d domains", text), text
    assert (killed / "report.png").stat().st_size > 1000
    # and bit for bit the same models: the base, every expert, the student
    for model in ("experts/base/model", *(f"experts/experts/{d}/hf_policy" for d in ("addition", "max", "parity")),
                  "merge/student"):
        assert weights(killed / model) == weights(straight / model), model
    # which moved: the experts and the student are not their base
    assert weights(straight / "merge/student") != weights(straight / "experts/base/model")
    assert weights(straight / "experts/experts/max/hf_policy") != weights(straight / "experts/base/model")


def test_bad_input_and_a_failed_expert_are_named(tmp_path):
    done = run(tmp_path / "empty", "domains={addition: [{builtin: addition}], max: []}")
    assert done.returncode == 2 and "Traceback" not in done.stderr + done.stdout
    assert "domain 'max' has no data source" in done.stderr + done.stdout
    with pytest.raises(ValueError, match=r"merge.logging.run_dir is the recipe's \(.*/merge, from run_dir\)"):
        load_config(None, [*TINY, f"run_dir={tmp_path}", "merge.logging.run_dir=elsewhere"], schema=RecipeConfig)

    # a stray file where expert 'max' would run: its job fails, the other experts finish and are kept
    run_dir = tmp_path / "failed"
    stray = run_dir / "experts" / "experts" / "max"
    stray.mkdir(parents=True)
    (stray / "metrics.jsonl").write_text("{}\n")
    done = run(run_dir)
    out = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in out, out[-3000:]
    assert "expert 'max'" in out and "holds the files of an earlier run" in out
    assert "the merge needs every domain's expert and will not start: missing max (the finished experts are kept" in out
    for kept in ("addition", "parity"):
        assert (run_dir / "experts" / "experts" / kept / "expert.json").exists()
    assert not (run_dir / "merge").exists()


def test_lora_experts_are_adapters_on_one_base_and_the_merge_holds_that_base_once(tmp_path):
    """`expert.model.lora`: every expert trains an adapter on the shared base (its warm start and
    its RL; the base's weights untouched) and exports it in PEFT's format naming the base beside
    its merged weights; the merge's teachers hold the base once and the three adapters."""
    import jax
    import numpy as np
    from flax import nnx

    from opd_jax.merge.experts import base_dir, expert_dir
    from opd_jax.models import load_model
    from opd_jax.models.adapter_io import load_adapter

    done = run(tmp_path, "expert.model.lora={rank: 2, alpha: 4, targets: [q_proj, v_proj, up_proj]}")
    assert done.returncode == 0, done.stderr[-3000:]
    base, _ = load_model(base_dir(tmp_path / "experts") / "model")
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(base, nnx.Param)))
    for domain in ("addition", "max", "parity"):
        export = expert_dir(tmp_path / "experts", domain) / "hf_policy"
        adapter = json.loads((export / "adapter" / "adapter_config.json").read_text())
        assert Path(adapter["base_model_name_or_path"]) == (base_dir(tmp_path / "experts") / "model").resolve()
        assert adapter["target_modules"] == ["q_proj", "v_proj", "up_proj"] and adapter["r"] == 2
        merged, _ = load_model(export)
        adapted = load_adapter(load_model(base_dir(tmp_path / "experts") / "model")[0], export / "adapter")
        tokens = np.arange(1, 13, dtype=np.int32)[None]
        np.testing.assert_allclose(np.asarray(adapted(tokens)), np.asarray(merged(tokens)), atol=1e-4)
        # only the adapted projections differ from the base: the rest was frozen
        for name in ("k", "o", "down", "attn_norm"):
            np.testing.assert_array_equal(np.asarray(getattr(merged.backbone.layers, name)[...]),
                                          np.asarray(getattr(base.backbone.layers, name)[...]))
        assert np.abs(np.asarray(merged.backbone.layers.q[...]) - np.asarray(base.backbone.layers.q[...])).max() > 0
    report = json.loads((tmp_path / "merge" / "report.json").read_text())
    assert base_bytes < report["teachers_gib"] * 2**30 < 1.5 * base_bytes  # one base + three rank-2 adapters
    assert set(report["domains"]) == {"addition", "max", "parity"}
