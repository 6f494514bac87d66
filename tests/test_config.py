"""Configs: YAML plus dotted overrides into the typed schema; every error names the dotted key."""

from pathlib import Path

import pytest

from opd_jax.config import ConfigError, load_config, save_config
from opd_jax.core import MismatchCorrection, PPOConfig
from rollout_bridge import sglang_jax


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_yaml_and_overrides_reach_the_core_dataclasses(tmp_path):
    path = write(tmp_path, """
steps: 30
model:
  fresh: {hidden_size: 64, num_layers: 2}
algorithm:
  ppo:
    lam_policy: adaptive
    mismatch: {kind: tis, hi: 3.0}
  policy_optimizer: {learning_rate: 3.0e-4, max_grad_norm: 0.5}
rollout: {samples_per_prompt: 4, dtype: bfloat16}
data:
  train: [{builtin: addition}, {jsonl: prompts.jsonl, weight: 2}]
""")
    config = load_config(path, ["algorithm.ppo.eps_high=0.3", "rollout.samples_per_prompt=8", "mesh.fsdp=2"])
    assert config.steps == 30 and config.model.fresh.hidden_size == 64 and config.model.fresh.num_heads == 4
    ppo = config.algorithm.ppo
    assert isinstance(ppo, PPOConfig) and ppo.eps_high == 0.3 and ppo.eps_low == 0.2 and ppo.lam_policy == "adaptive"
    assert ppo.mismatch == MismatchCorrection("tis", hi=3.0)
    assert config.algorithm.policy_optimizer.learning_rate == 3e-4
    assert config.rollout.samples_per_prompt == 8 and config.rollout.dtype == "bfloat16"
    assert config.mesh.fsdp == 2 and config.data.train[1].jsonl == "prompts.jsonl"
    # the resolved config round-trips
    save_config(config, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == config


@pytest.mark.parametrize("overrides,message", [
    (["algorithm.ppo.epz=1"], "algorithm.ppo.epz: unknown key"),
    (["rollout.temperature=hot"], "rollout.temperature: Input should be a valid number"),
    (["algorithm.ppo.mismatch.kind=icepoo"], "algorithm.ppo.mismatch.kind: Input should be 'none', 'icepop'"),
    (["algorithm.ppo.dual_clip=0.5"], "algorithm.ppo: Value error, dual_clip must be > 1"),
    (["mesh.data=0"], "mesh: Value error, mesh axis sizes must be positive or -1"),
    (["rollout.samples_per_prompt=0"], "rollout.samples_per_prompt: Input should be greater than 0"),
    (["data.train=[{builtin: addition, wieght: 2}]"], "data.train.0.wieght: unknown key"),
    (["data.train=[{weight: 2}]"], "data.train.0: Value error, a data source sets exactly one of builtin and jsonl"),
    (["model.fresh.num_layers=2", "model.path=x"], "model: Value error, set exactly one of model.path and model.fresh"),
    (["steps"], "override 'steps' is not of the form key.path=value"),
])
def test_bad_keys_and_values_are_named(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


def test_bad_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="run.yaml"):
        load_config(write(tmp_path, "steps: [1, 2\n"))
    with pytest.raises(ConfigError, match="steps: Input should be a valid integer"):
        load_config(write(tmp_path, "steps: many\n"))


def test_the_sglang_quickstart_launches_what_the_bridge_tests_launch():
    config = load_config(Path(__file__).parents[1] / "configs" / "quickstart_sglang.yaml", [])
    assert config.rollout.engine == "sglang" and config.rollout.launch.env == sglang_jax.ENV
    assert config.rollout.launch.command == sglang_jax.command(".sglang-jax-venv/bin/python")
    assert config.model.fresh.head_dim == 128  # sglang-jax's CPU attention needs it


def test_sglang_engine_settings_are_checked():
    with pytest.raises(ConfigError, match="exactly one of rollout.urls"):
        load_config(None, ["rollout.engine=sglang"])
    with pytest.raises(ConfigError, match="for engine 'sglang'"):
        load_config(None, ["rollout.urls=[http://127.0.0.1:1]"])
