"""Bad model input is a clear error that names the problem, raised before any JAX code runs."""

import json

import pytest
from hf_reference import make_hf_model

from opd_jax.models import ModelConfig, ModelFormatError, load_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_hf_model("llama", directory)
    return directory


def edited_copy(saved, tmp_path, edit):
    tmp_path.mkdir(parents=True, exist_ok=True)
    for f in saved.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_missing_path(tmp_path):
    with pytest.raises(ModelFormatError, match="no such file or directory"):
        load_model(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelFormatError, match=r"config\.json: file not found"):
        load_model(tmp_path)


def test_unknown_architecture(saved, tmp_path):
    path = edited_copy(saved, tmp_path, lambda c: c.update(model_type="gpt2", architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ModelFormatError, match="model_type 'gpt2' is not supported; supported: llama, qwen2, qwen3"):
        load_model(path)


def test_missing_architecture(saved, tmp_path):
    path = edited_copy(saved, tmp_path, lambda c: (c.pop("model_type"), c.pop("architectures")))
    with pytest.raises(ModelFormatError, match="no 'model_type' or known 'architectures'"):
        load_model(path)


def test_missing_required_field(saved, tmp_path):
    path = edited_copy(saved, tmp_path, lambda c: c.pop("intermediate_size"))
    with pytest.raises(ModelFormatError, match="required field 'intermediate_size' is missing"):
        load_model(path)


def test_shapes_that_do_not_match_the_config(saved, tmp_path):
    path = edited_copy(saved, tmp_path, lambda c: c.update(intermediate_size=128))
    with pytest.raises(ModelFormatError, match=r"tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' has shape "
                                               r"\(96, 64\), but config\.json implies \(128, 64\)"):
        load_model(path)


def test_missing_and_unexpected_tensors(saved, tmp_path):
    path = edited_copy(saved, tmp_path, lambda c: c.update(num_hidden_layers=3))
    with pytest.raises(ModelFormatError, match=r"tensor 'model\.layers\.2\..*' \(and \d+ more\) is missing"):
        load_model(path)
    (tmp_path / "b").mkdir()
    path2 = edited_copy(saved, tmp_path / "b", lambda c: c.update(num_hidden_layers=1))
    with pytest.raises(ModelFormatError, match=r"unexpected tensor 'model\.layers\.1\..*' \(9 in all\) is not "
                                               r"part of the 1-layer LlamaForCausalLM"):
        load_model(path2)


def test_corrupt_safetensors(saved, tmp_path):
    path = edited_copy(saved, tmp_path, lambda c: None)
    (path / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ModelFormatError, match=r"model\.safetensors: cannot be read as safetensors"):
        load_model(path)


def test_index_naming_a_missing_shard(saved, tmp_path):
    path = edited_copy(saved, tmp_path, lambda c: None)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00002.safetensors"}}))
    with pytest.raises(ModelFormatError, match="lists model-00002.safetensors, which does not exist"):
        load_model(path)


def test_invalid_config_values():
    with pytest.raises(ModelFormatError, match=r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"):
        ModelConfig(family="llama", vocab_size=10, hidden_size=12, intermediate_size=8, num_layers=1,
                    num_heads=6, num_kv_heads=4, head_dim=2)
    with pytest.raises(ModelFormatError, match="hidden_size must be a positive integer"):
        ModelConfig(family="llama", vocab_size=10, hidden_size=0, intermediate_size=8, num_layers=1,
                    num_heads=1, num_kv_heads=1, head_dim=2)


def test_unsupported_rope_scaling(saved, tmp_path):
    path = edited_copy(saved, tmp_path, lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ModelFormatError, match="rope_scaling type 'yarn' is not supported"):
        load_model(path)


def test_bad_dtype(saved):
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        load_model(saved, dtype="int8")


@pytest.fixture(scope="module")
def saved_moe(tmp_path_factory):
    directory = tmp_path_factory.mktemp("glm4_moe")
    make_hf_model("glm4_moe", directory)
    return directory


def test_moe_checkpoint_that_disagrees_with_its_config(saved_moe, tmp_path):
    fewer = edited_copy(saved_moe, tmp_path / "fewer", lambda c: c.update(n_routed_experts=4))
    with pytest.raises(ModelFormatError, match=r"unexpected tensor 'model\.layers\.1\.mlp\.experts\.4\.[a-z_]+\.weight' "
                                               r"\(\d+ in all\)"):
        load_model(fewer)
    more = edited_copy(saved_moe, tmp_path / "more", lambda c: c.update(n_routed_experts=12))
    with pytest.raises(ModelFormatError, match=r"tensor 'model\.layers\.1\.mlp\.experts\.8\.[a-z_]+\.weight' .* is "
                                               r"missing"):
        load_model(more)
    # a router of the wrong shape, the rest as config.json says
    from safetensors.numpy import load_file, save_file
    router = edited_copy(saved_moe, tmp_path / "router", lambda c: None)
    tensors = load_file(router / "model.safetensors")
    tensors["model.layers.2.mlp.gate.weight"] = tensors["model.layers.2.mlp.gate.weight"][:7]
    save_file(tensors, str(router / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match=r"tensor 'model\.layers\.2\.mlp\.gate\.weight' has shape \(7, 64\), but "
                                               r"config\.json implies \(8, 64\)"):
        load_model(router)


def test_unknown_moe_option(saved_moe, tmp_path):
    path = edited_copy(saved_moe, tmp_path, lambda c: c.update(moe_layer_freq=2))
    with pytest.raises(ModelFormatError, match=r"config\.json: MoE option 'moe_layer_freq' is not supported for "
                                               r"glm4_moe"):
        load_model(path)
    path = edited_copy(saved_moe, tmp_path, lambda c: c.update(num_experts_per_tok=9))
    with pytest.raises(ModelFormatError, match=r"experts_per_token \(9\) must be in \[1, num_experts \(8\)\]"):
        load_model(path)
