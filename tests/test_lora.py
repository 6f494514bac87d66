"""LoRA adapters: zero B is the base model's function; the adapter forward equals the merged
weights; PEFT (with transformers, the reference) loads our adapter with our logits, and we load
PEFT's; only the adapters (and a critic's value head) train."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import torch
import transformers
from flax import nnx
from hf_reference import hf_logits, make_hf_model

from opd_jax.config import ConfigError, TrainConfig, load_config
from opd_jax.core.update import accumulate_grads, apply_update, split_trainable, trainable
from opd_jax.models import ValueModel, load_model, save_model
from opd_jax.models.adapter_io import load_adapter, save_adapter
from opd_jax.models.config import ModelFormatError
from opd_jax.models.lora import LoraConfig

TOKENS = np.random.default_rng(0).integers(0, 97, (2, 9)).astype(np.int32)


def _close(ours, ref, rtol=1e-4):
    np.testing.assert_allclose(ours, ref, rtol=0, atol=rtol * np.max(np.abs(ref)))


def _randomise_b(model, seed=1, scale=0.2):
    """Non-zero B everywhere (as after training), so an adapter that is ignored or misplaced shows."""
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    for name, var in sorted(vars(model.backbone.layers).items()):
        if name.endswith("_lora_b"):
            var[...] = scale * jax.random.normal(next(keys), var[...].shape, var[...].dtype)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_hf_model("llama", directory)
    return directory


def _adapted(base_dir, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), rank=4):
    model, _ = load_model(base_dir)
    return model.add_lora(LoraConfig(rank=rank, alpha=8.0, targets=tuple(targets)), nnx.Rngs(3))


def test_zero_b_is_the_base_model_and_adapters_change_it(base_dir):
    base, _ = load_model(base_dir)
    model = _adapted(base_dir)
    np.testing.assert_array_equal(np.asarray(model(jnp.asarray(TOKENS))), np.asarray(base(jnp.asarray(TOKENS))))
    _randomise_b(model)
    assert np.max(np.abs(np.asarray(model(jnp.asarray(TOKENS))) - np.asarray(base(jnp.asarray(TOKENS))))) > 1e-2


@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                                     ("q_proj", "v_proj")])
def test_peft_loads_our_adapter_with_our_logits_and_the_merged_export_is_the_same_model(base_dir, tmp_path, targets):
    model = _adapted(base_dir, targets)
    _randomise_b(model)
    ours = np.asarray(model(jnp.asarray(TOKENS)))
    save_adapter(model, tmp_path / "adapter", base_model=str(base_dir))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    with_adapter = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    _close(ours, hf_logits(with_adapter, TOKENS))
    save_model(model, tmp_path / "merged")  # adapters folded into the weights
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    _close(ours, hf_logits(merged, TOKENS))


def test_we_load_an_adapter_peft_trained_with_its_logits(base_dir, tmp_path):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    theirs = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=12, target_modules=["k_proj", "o_proj", "down_proj"],
                                                     init_lora_weights=False))  # random B: a trained adapter
    theirs.save_pretrained(tmp_path)
    model, _ = load_model(base_dir)
    load_adapter(model, tmp_path)
    assert model.config.lora == LoraConfig(rank=4, alpha=12.0, targets=("down_proj", "k_proj", "o_proj"))
    _close(np.asarray(model(jnp.asarray(TOKENS))), hf_logits(theirs.eval(), TOKENS))


def test_a_broken_adapter_is_one_line_naming_the_tensor(base_dir, tmp_path):
    model = _adapted(base_dir, ("q_proj",))
    save_adapter(model, tmp_path)
    other, _ = load_model(base_dir)
    config = (tmp_path / "adapter_config.json").read_text()
    (tmp_path / "adapter_config.json").write_text(config.replace('"r": 4', '"r": 5'))
    with pytest.raises(ModelFormatError, match=r"q_proj.lora_A.weight' has shape \(4, 64\), the model needs \(5, 64\)"):
        load_adapter(other, tmp_path)
    (tmp_path / "adapter_config.json").write_text(config.replace('"use_dora": false', '"use_dora": true'))
    with pytest.raises(ModelFormatError, match="use_dora=True is not supported"):
        load_adapter(load_model(base_dir)[0], tmp_path)


def test_a_target_the_decoder_lacks_is_one_error_naming_the_key_and_the_modules():
    with pytest.raises(ConfigError, match=r"model\.lora\.targets: .*no module 'c_attn' to adapt; the decoder has "
                                          r"q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"):
        load_config("configs/quickstart.yaml", ["model.lora={targets: [q_proj, c_attn]}"], schema=TrainConfig)


def test_only_the_adapters_and_the_value_head_train(base_dir):
    """Gradients and optimizer state cover the adapters (and a critic's value head) alone; the
    base is bit-for-bit the same after an update, the adapters moved."""
    model = _adapted(base_dir, ("q_proj", "down_proj"))
    _randomise_b(model)  # at B = 0 A's gradient is zero (it flows through B), so A would not move yet
    critic = ValueModel.from_policy(model, head_init="small", key=jax.random.key(0))
    for module in (model, critic):
        _, params = nnx.split(module, nnx.Param)
        train, frozen = split_trainable(params)
        names = {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(train)}
        expected = {f"backbone/layers/{w}_lora_{s}" for w in ("q", "down") for s in "ab"}
        assert names == (expected | {"value_head", "value_bias"} if module is critic else expected)
        tx = optax.adam(1e-2)
        opt = tx.init(trainable(params))
        assert len(jax.tree.leaves(opt)) == 1 + 2 * len(names)  # count + two moments per trained array

        def loss(p, _, m=module):
            out = nnx.merge(nnx.graphdef(m), p)(jnp.asarray(TOKENS))
            return jnp.mean(out ** 2), {}

        grads, _ = accumulate_grads(loss, params, None, 1, None)
        assert jax.tree.structure(grads) == jax.tree.structure(train)
        new, _, _ = apply_update(tx, params, opt, grads)
        _, new_frozen = split_trainable(new)
        for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(new_frozen)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        moved = [np.max(np.abs(np.asarray(a) - np.asarray(b)))
                 for a, b in zip(jax.tree.leaves(train), jax.tree.leaves(split_trainable(new)[0]))]
        assert min(moved) > 0


def test_a_qlora_run_killed_during_a_save_resumes_exactly(tmp_path):
    """The loop tests' run (a MoE policy with routing replay, sharded over 8 devices, a critic and a
    KL reference) with adapters on every projection and routed expert over an int4 base (QLoRA):
    SIGKILL while saving step 4, resume; the parameters (the base still int4) and optimizer states
    (adapters only) equal an uninterrupted run's."""
    import subprocess
    import sys
    from pathlib import Path

    from train_loop_settings import RESUME_ARGS, TINY, like_state

    from opd_jax.models.quant import QuantizedWeight
    from opd_jax.train import train
    from opd_jax.train.checkpoint import Checkpoints
    from opd_jax.train.metrics import read_metrics

    lora = ["model.lora={rank: 4, alpha: 8, base_quantization: {kind: int4, block_size: 32}}", "steps=4"]
    straight = train(load_config(None, [*TINY, *RESUME_ARGS, *lora, f"logging.run_dir={tmp_path / 'straight'}"]))
    worker = Path(__file__).with_name("kill_during_save.py")
    killed = subprocess.run([sys.executable, str(worker), str(tmp_path / "killed"), *lora], capture_output=True,
                            text=True, timeout=1800)
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = train(load_config(None, [*TINY, *RESUME_ARGS, *lora, f"logging.run_dir={tmp_path / 'killed'}"]),
                    resume=True)
    states = []
    for run in (straight, resumed):
        checkpoints = Checkpoints(run / "checkpoints", keep=2)
        try:
            states.append(checkpoints.restore(4, like_state(straight))[0])
            held = list(checkpoints._recorded_tree(4))
        finally:
            checkpoints.close()
        # the checkpoint holds the adapters (policy, critic, reference), the value head and optimizer
        # states, not the frozen base, which the run rebuilds from its config
        params = [p for p in held if p.lstrip(".").startswith(("policy", "critic", "reference")) and "_opt" not in p]
        assert params and all("lora" in p or "value_" in p for p in params), params
    a, b = states
    q = a.policy["backbone"]["layers"]["expert_up"][...]
    assert isinstance(q, QuantizedWeight) and q.q.qvalue.dtype == jnp.int4  # held and checkpointed as int4
    assert any(r.get("policy/grad_norm", 0) > 0 for r in read_metrics(straight / "metrics.jsonl"))
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    adapters = trainable(a.policy)
    assert nbytes(adapters) < nbytes(a.policy) / 2
    assert 2 * nbytes(adapters) <= nbytes(a.policy_opt) < 2 * nbytes(adapters) + 64  # Adam's moments: adapters only
    for x, y in zip(jax.tree.leaves((a.policy, a.critic, a.policy_opt, a.critic_opt, a.reference)),
                    jax.tree.leaves((b.policy, b.critic, b.policy_opt, b.critic_opt, b.reference)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_engine_runs_a_qlora_policy_as_the_trainer_computes_it(base_dir):
    """A QLoRA policy (int8 base, trained adapters): the engine's copy (adapters merged into the
    dequantized base, at the trainer's precision) gives the trainer's logits; the quantized base
    is a different function from the full-precision one."""
    from opd_jax.models.quant import QuantScheme, quantize_decoder
    from opd_jax.train.build import EngineNumerics, engine_model

    model = _adapted(base_dir)
    _randomise_b(model)
    full = np.asarray(model(jnp.asarray(TOKENS)))
    quantize_decoder(model, QuantScheme("int8", "channel"))
    trainer = np.asarray(model(jnp.asarray(TOKENS)))
    engine = engine_model(model.config, nnx.state(model, nnx.Param), EngineNumerics())
    assert engine.config.lora is None
    _close(np.asarray(engine(jnp.asarray(TOKENS))), trainer, rtol=1e-5)
    assert np.max(np.abs(trainer - full)) > 1e-4


def test_a_checkpoint_holds_the_adapters_and_refuses_another_base(base_dir, tmp_path):
    """A LoRA state's checkpoint leaves the frozen base out (it records the base's fingerprint);
    restored onto the same base it is the saved state; onto a changed base, one line says so and
    the checkpoint stays where it is."""
    from opd_jax.core.state import PolicyState
    from opd_jax.train.checkpoint import CheckpointMismatch, Checkpoints

    def state_on(model):
        return PolicyState.create(model, optax.adam(1e-3))

    model = _adapted(base_dir, ("q_proj",))
    _randomise_b(model)
    saved = state_on(model)
    checkpoints = Checkpoints(tmp_path, keep=2)
    try:
        checkpoints.save(1, saved, {})
        held = checkpoints._recorded_tree(1)
        assert [p for p in held if "params" in p] and all("lora" in p for p in held if "params" in p)
        step, restored, _ = checkpoints.restore_latest(state_on(_adapted(base_dir, ("q_proj",))))
        assert step == 1
        for x, y in zip(jax.tree.leaves(saved), jax.tree.leaves(restored), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        other = _adapted(base_dir, ("q_proj",))
        other.backbone.layers.k[...] = other.backbone.layers.k[...] * 1.01
        with pytest.raises(CheckpointMismatch, match="adapters trained on another base"):
            checkpoints.restore_latest(state_on(other))
        assert checkpoints.latest_step() == 1
    finally:
        checkpoints.close()
