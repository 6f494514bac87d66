"""Configs: YAML plus dotted overrides into the typed schema; every error names the dotted key."""

from pathlib import Path

import pytest

from opd_jax.config import ConfigError, TrainConfig, load_config, save_config
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
    surrogate: {mismatch: {kind: tis, hi: 3.0}}
  policy_optimizer: {learning_rate: 3.0e-4, max_grad_norm: 0.5}
rollout: {samples_per_prompt: 4, dtype: bfloat16}
data:
  train: [{builtin: addition}, {jsonl: prompts.jsonl, weight: 2}]
""")
    config = load_config(path, ["algorithm.ppo.surrogate.eps_high=0.3", "rollout.samples_per_prompt=8", "mesh.fsdp=2"])
    assert config.steps == 30 and config.model.fresh.hidden_size == 64 and config.model.fresh.num_heads == 4
    ppo = config.algorithm.ppo
    assert isinstance(ppo, PPOConfig) and ppo.lam_policy == "adaptive"
    assert ppo.surrogate.eps_high == 0.3 and ppo.surrogate.eps_low == 0.2
    assert ppo.surrogate.mismatch == MismatchCorrection("tis", hi=3.0)
    assert config.algorithm.policy_optimizer.learning_rate == 3e-4
    assert config.rollout.samples_per_prompt == 8 and config.rollout.dtype == "bfloat16"
    assert config.mesh.fsdp == 2 and config.data.train[1].jsonl == "prompts.jsonl"
    # the resolved config round-trips
    save_config(config, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == config


@pytest.mark.parametrize("overrides,message", [
    (["algorithm.ppo.epz=1"], "algorithm.ppo.epz: unknown key"),
    (["rollout.temperature=hot"], "rollout.temperature: Input should be a valid number"),
    (["algorithm.ppo.surrogate.mismatch.kind=icepoo"],
     "override 'algorithm.ppo.surrogate.mismatch.kind=icepoo': algorithm.ppo.surrogate.mismatch.kind: unknown mismatch "
     "correction 'icepoo'; choose one of none, icepop"),
    (["algorithm.ppo.surrogate.dual_clip=0.5"],
     "override 'algorithm.ppo.surrogate.dual_clip=0.5': algorithm.ppo.surrogate: dual_clip must be > 1"),
    (["mesh.data=0"], "override 'mesh.data=0': mesh: mesh axis sizes must be positive or -1"),
    # a plugin's typo names the key and the override, not the file, and no pydantic prefix
    (["algorithm.ppo.advantage=my_pkgg:est"], "override 'algorithm.ppo.advantage=my_pkgg:est': algorithm.ppo.advantage: "
                                              "advantage estimator 'my_pkgg:est': cannot import 'my_pkgg'"),
    (["rollout.samples_per_prompt=0"], "rollout.samples_per_prompt: Input should be greater than 0"),
    (["data.train=[{builtin: addition, wieght: 2}]"], "data.train.0.wieght: unknown key"),
    (["data.train=[{weight: 2}]"], "data.train.0: a data source sets exactly one of builtin, jsonl and environment"),
    (["data.train=[{environment: search, params: {colour: 2}}]"], "environment 'search' does not take the parameters"),
    (["data.train=[{environment: no_such_module:make}]"], "cannot import 'no_such_module'"),
    (["model.fresh.num_layers=2", "model.path=x"], "model: set exactly one of model.path and model.fresh; to train the "
                                                   "model at model.path, drop the config's fresh model with the override "
                                                   "model.fresh=null"),
    (["steps"], "override 'steps' is not of the form key.path=value"),
])
def test_bad_keys_and_values_are_named(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value) and "Value error" not in str(info.value) and "\n" not in str(info.value)


def test_bad_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="run.yaml"):
        load_config(write(tmp_path, "steps: [1, 2\n"))
    with pytest.raises(ConfigError, match="steps: Input should be a valid integer"):
        load_config(write(tmp_path, "steps: many\n"))


def test_the_sglang_quickstart_launches_what_the_bridge_tests_launch():
    config = load_config(Path(__file__).parents[1] / "configs" / "quickstart_sglang.yaml", [])
    assert config.rollout.engine == "sglang" and config.rollout.sglang.launch.env == sglang_jax.ENV
    assert config.rollout.sglang.launch.command == sglang_jax.command(".sglang-jax-venv/bin/python")
    assert config.model.fresh.head_dim == 128  # sglang-jax's CPU attention needs it


def test_sglang_engine_settings_are_checked():
    with pytest.raises(ConfigError, match="exactly one of rollout.sglang.urls"):
        load_config(None, ["rollout.engine=sglang"])
    with pytest.raises(ConfigError, match="are for rollout.engine 'sglang'"):
        load_config(None, ["rollout.sglang.urls=[http://127.0.0.1:1]"])
    with pytest.raises(ConfigError, match="decode_slots is the embedded engine's"):
        load_config(None, ["rollout.engine=sglang", "rollout.sglang.urls=[http://127.0.0.1:1]", "rollout.decode_slots=8"])
    with pytest.raises(ConfigError, match="rollout.decode_slots: Input should be greater than 0"):
        load_config(None, ["rollout.decode_slots=0"])


@pytest.mark.parametrize("schema,key", [
    ("train", "algorithm.ppo.group_size=2"), ("train", "algorithm.ppo.temperature=0.7"),
    ("merge", "opd.group_size=2"), ("merge", "opd.num_teachers=3"), ("merge", "opd.temperature=0.7"),
])
def test_facts_of_the_run_are_not_knobs(schema, key):
    """Samples per prompt, the number of teachers and the sampling temperature are set once
    (rollout.samples_per_prompt, the teachers, rollout.temperature); the steps get them from the
    run, so these keys do not exist and cannot be set to something the loop then overrides."""
    from opd_jax.config import MergeConfig
    overrides = [key] if schema == "train" else [key, "experts_dir=x"]
    with pytest.raises(ConfigError, match=f"{key.split('=')[0]}: unknown key"):
        load_config(None, overrides, schema=TrainConfig if schema == "train" else MergeConfig)


def test_every_config_key_is_described_and_the_reference_is_current():
    from opd_jax.config.commands import command_schemas
    from opd_jax.config.reference import key_docs, reference_markdown
    for command, schema in command_schemas().items():
        undescribed = [d.key for d in key_docs(schema) if not d.description]
        assert not undescribed, (command, undescribed)
    reference = Path(__file__).parents[1] / "docs" / "config.md"
    assert reference.read_text() == reference_markdown(command_schemas()), \
        "docs/config.md is stale: python -m opd_jax.config.reference > docs/config.md"


def test_the_estimators_are_selectable_and_rloo_needs_groups():
    config = load_config(None, ["algorithm.ppo.advantage=reinforce++", "algorithm.ppo.surrogate.kind=gspo",
                                "algorithm.ppo.surrogate.eps_low=3e-4", "algorithm.ppo.surrogate.eps_high=4e-4"])
    assert config.algorithm.ppo.advantage == "reinforce++" and config.algorithm.ppo.surrogate.kind == "gspo"
    with pytest.raises(ConfigError, match="advantage rloo needs at least 2 samples per prompt"):
        load_config(None, ["algorithm.ppo.advantage=rloo", "rollout.samples_per_prompt=1"])
    with pytest.raises(ConfigError, match="dual_clip applies to the policy losses ppo, gspo; cispo"):
        load_config(None, ["algorithm.ppo.surrogate.kind=cispo", "algorithm.ppo.surrogate.dual_clip=3"])


def test_the_fresh_model_sections_name_only_fields_of_the_model_dataclasses():
    """model.fresh and model.fresh.moe pass every field under its own name to ModelConfig /
    MoEConfig (train.build): a field renamed on one side fails here, not in a run."""
    import dataclasses

    from opd_jax.config import FreshModel
    from opd_jax.config.schema import FreshDSA, FreshMLA, FreshMoE
    from opd_jax.models import ModelConfig
    from opd_jax.models.mla import DSAConfig, MLAConfig
    from opd_jax.models.moe import MoEConfig
    from opd_jax.train.build import fresh_model_config

    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(FreshModel.model_fields) - {"seed"} <= model_fields
    assert set(FreshMoE.model_fields) <= {f.name for f in dataclasses.fields(MoEConfig)}
    assert set(FreshMLA.model_fields) == {f.name for f in dataclasses.fields(MLAConfig)}
    assert set(FreshDSA.model_fields) == {f.name for f in dataclasses.fields(DSAConfig)}
    fresh = FreshModel(family="glm4_moe", num_layers=2, moe=FreshMoE(num_experts=4, n_group=2, dense_layers=[0]))
    built = fresh_model_config(fresh)
    for name in set(FreshModel.model_fields) - {"seed", "moe"}:
        assert getattr(built, name) == getattr(fresh, name), name
    assert built.moe.router == "sigmoid" and built.moe.score_correction_bias and built.moe.dense_layers == (0,)
    assert built.moe.num_experts == 4 and built.moe.n_group == 2
    # GLM-5: MLA sets the heads' key/value count and rotary width; a run's config.yaml says what the model has
    glm5 = FreshModel(family="glm_moe_dsa", num_layers=2, num_heads=4, moe=FreshMoE(num_experts=4),
                      mla=FreshMLA(qk_rope_head_dim=8), dsa=FreshDSA(indexer_types=["full", "shared"]))
    assert (glm5.head_dim, glm5.num_kv_heads) == (8, 4)
    built = fresh_model_config(FreshModel(**glm5.model_dump()))  # as a saved config.yaml reloads
    assert built.mla.qk_rope_head_dim == built.head_dim == 8 and built.dsa.indexer_types == ("full", "shared")
    with pytest.raises(ValueError, match=r"model.fresh.head_dim is 32, but glm_moe_dsa takes it from "
                                         r"model.fresh.mla.qk_rope_head_dim \(8\): leave head_dim out or set it to 8"):
        FreshModel(**{**glm5.model_dump(), "head_dim": 32})
