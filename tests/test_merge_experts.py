"""`opd-jax experts`: the base, then the experts as parallel jobs in processes of their own, each
ending in an exported model and its own-domain evaluation; finished work is kept and an
interrupted expert resumes; jobs that cannot run say why."""

import json

import pytest
from merge_settings import BASE_AND_EXPERTS

from opd_jax.config import ExpertsConfig, load_config, save_config
from opd_jax.merge import ExpertsError, run_experts
from opd_jax.merge.experts import expert_dir
from opd_jax.models import load_model

TINY = [*BASE_AND_EXPERTS, "base.sft.steps=3", "expert.steps=2", "expert.logging.eval_every=2", "expert.checkpoint.every=2",
        "experts={addition: [{builtin: addition, params: {digits: 1}}], max: [{builtin: max, params: {hi: 9}}]}"]


def config(run_dir, *extra) -> ExpertsConfig:
    return load_config(None, [*TINY, f"run_dir={run_dir}", *extra], schema=ExpertsConfig)


def test_experts_as_parallel_jobs_then_kept_and_resumed(tmp_path):
    cfg = config(tmp_path, "launch.jobs=2", "launch.devices_per_job=1", "launch.device_env=OPD_JAX_TEST_DEVICES")
    run_experts(cfg)
    manifest = json.loads((tmp_path / "experts.json").read_text())
    assert set(manifest["experts"]) == {"addition", "max"}
    for name, expert in manifest["experts"].items():
        assert expert["domains"] == [name] and set(expert["eval"]) == {name}
        model, tokenizer = load_model(expert["model"])
        assert tokenizer is not None and model.config.hidden_size == 32
        # the expert's first evaluation is the base's, on the same held-out prompts
        assert expert["eval_at_start"][name] == pytest.approx(manifest["base"]["eval"][name], abs=1 / 8)
        assert (expert_dir(tmp_path, name) / "job.log").exists()  # a process of its own
    assert set(manifest["base"]["eval"]) == {"addition", "max"}

    # finished experts are kept; one whose summary was lost continues from its last checkpoint
    (expert_dir(tmp_path, "max") / "expert.json").unlink()
    kept = (expert_dir(tmp_path, "addition") / "expert.json").read_text()
    run_experts(config(tmp_path))
    again = json.loads((tmp_path / "experts.json").read_text())
    assert (expert_dir(tmp_path, "addition") / "expert.json").read_text() == kept
    assert again["experts"]["max"]["resumed"] and again["experts"]["max"]["eval"] == manifest["experts"]["max"]["eval"]


def test_jobs_that_cannot_run_say_why(tmp_path):
    with pytest.raises(ExpertsError, match="needs the base, which is not built yet: run `opd-jax experts CONFIG --only base`"):
        run_experts(config(tmp_path), only="max")
    with pytest.raises(ExpertsError, match="no expert 'sort'; the config has: addition, max"):
        run_experts(config(tmp_path), only="sort")
    with pytest.raises(ValueError, match="expert name 'base'"):
        config(tmp_path, "experts={base: [{builtin: max}]}")
    # a job that fails in its own process is named, with the tail of its log
    bad = config(tmp_path / "bad", "launch.jobs=2", "expert.mesh.data=3")
    # (the job's own CLI reports its user error in one line, exit status 2)
    with pytest.raises(ExpertsError, match=r"(?s)these jobs failed:\nbase \(exit 2, log .*job.log\):\n"
                                           r"error: mesh \(data=3, fsdp=1, sequence=1, tensor=1\) needs 3 devices"):
        run_experts(bad)
    save_config(bad, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml", schema=ExpertsConfig) == bad
