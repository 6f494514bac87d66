"""LoRA adapters: zero B is the base model's function; the adapter forward equals the merged
weights; PEFT (with transformers, the reference) loads our adapter with our logits, and we load
PEFT's; only the adapters (and a critic's value head) train."""

import asyncio
import dataclasses
import json

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
from opd_jax.core import PPOState
from opd_jax.core.update import accumulate_grads, apply_update, split_trainable, trainable
from opd_jax.models import KVCache, ValueModel, load_model, save_model
from opd_jax.models.adapter_io import load_adapter, read_adapter_config, save_adapter
from opd_jax.models.config import ModelFormatError
from opd_jax.models.io import export_model
from opd_jax.models.lora import LoraConfig, bank

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


def test_an_adapter_on_a_base_built_fresh_is_exported_with_its_base(base_dir, tmp_path):
    """A LoRA run on model.fresh: its base exists nowhere else, so the export writes it beside the
    adapter (PATH/base) and names it in adapter_config.json; PEFT loads the pair by that name
    alone (AutoPeftModelForCausalLM) with our logits."""
    model = _adapted(base_dir, ("q_proj", "v_proj"))
    _randomise_b(model)
    ours = np.asarray(model(jnp.asarray(TOKENS)))
    export_model(model, tmp_path / "hf_policy")  # no base_model: built fresh
    recorded = json.loads((tmp_path / "hf_policy" / "adapter" / "adapter_config.json").read_text())
    assert recorded["base_model_name_or_path"] == str((tmp_path / "hf_policy" / "base").resolve())
    base, _ = load_model(tmp_path / "hf_policy" / "base")
    reference, _ = load_model(base_dir)
    np.testing.assert_array_equal(np.asarray(base(jnp.asarray(TOKENS))), np.asarray(reference(jnp.asarray(TOKENS))))
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "hf_policy" / "adapter").eval()
    _close(ours, hf_logits(loaded, TOKENS))


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


def _bank_of(models):
    """A decoder on models[0]'s base holding every model's adapters as one bank."""
    banked = nnx.merge(*nnx.split(models[0]))
    for name, param in bank([m.backbone.layers for m in models]).items():
        setattr(banked.backbone.layers, name, param)
    return banked


@pytest.mark.parametrize("moe", [False, True])
def test_a_bank_of_adapters_scores_each_row_as_its_own_adapter_does(moe):
    """Three adapters on one base in one forward (adapter_ids picks each row's): every row's
    logits are those of its own adapted model, on a dense model and on a MoE model's attention
    and shared experts; adapters on routed experts cannot be banked."""
    from ppo_setup import TINY, TINY_MOE

    from opd_jax.models import Decoder

    config = TINY_MOE if moe else TINY
    lora = LoraConfig(rank=3, alpha=6.0, targets=("q_proj", "o_proj", "gate_proj", "down_proj") if moe
                      else ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    models = []
    for seed in range(3):
        model = Decoder(config, rngs=nnx.Rngs(0)).add_lora(lora, nnx.Rngs(10 + seed))
        if moe:  # only the shared experts of the MLP names: drop the routed experts' adapters
            for name in [n for n in vars(model.backbone.layers) if n.startswith("expert_") and "_lora_" in n]:
                delattr(model.backbone.layers, name)
        _randomise_b(model, seed=seed)
        models.append(model)
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, (6, 7)).astype(np.int32)
    ids = np.asarray([2, 0, 1, 1, 2, 0], np.int32)
    ours = np.asarray(_bank_of(models)(jnp.asarray(tokens), adapter_ids=jnp.asarray(ids)))
    for b, i in enumerate(ids):
        _close(ours[b], np.asarray(models[i](jnp.asarray(tokens[b:b + 1])))[0])
    if moe:
        routed = Decoder(config, rngs=nnx.Rngs(0)).add_lora(lora, nnx.Rngs(1))
        with pytest.raises(ValueError, match="routed experts' adapters cannot be banked"):
            bank([routed.backbone.layers, routed.backbone.layers])
    other = Decoder(config, rngs=nnx.Rngs(0)).add_lora(LoraConfig(rank=2, alpha=4.0), nnx.Rngs(1))
    with pytest.raises(ValueError, match="adapter 1 adapts other weights, or at another rank"):
        bank([models[0].backbone.layers, other.backbone.layers])


def test_adapter_dropout_drops_the_adapters_input_in_training_only(base_dir, tmp_path):
    """LoRA dropout p (PEFT's lora_dropout): in training the adapter path sees x·m/(1−p), m ~
    Bernoulli(1−p), the base path x whole, so the projection is unbiased (its mean over many masks
    is the undropped one) and with B zero it is exact; without a key (scoring, rollouts) nothing
    is dropped. A key gives the same masks again; the training key differs by step and batch.
    PEFT's adapter_config carries p both ways; p outside [0, 1) is one line naming the key."""
    from opd_jax.core.forward import training_key
    from opd_jax.models.lora import Adapting, project

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.float32)
    w = {"q": jnp.asarray(rng.normal(size=(8, 2, 4)), jnp.float32),
         "q_lora_a": jnp.asarray(rng.normal(size=(8, 3)), jnp.float32),
         "q_lora_b": jnp.asarray(rng.normal(size=(3, 2, 4)), jnp.float32)}
    plain = np.asarray(project("bth,hnd->btnd", x, w, "q", Adapting(scale=2.0)))
    reference = np.einsum("bth,hnd->btnd", x, w["q"]) + 2.0 * np.einsum("bth,hr,rnd->btnd", x, w["q_lora_a"],
                                                                          w["q_lora_b"])
    _close(plain, reference, rtol=1e-5)
    drop = jax.jit(jax.vmap(lambda k: project("bth,hnd->btnd", x, w, "q", Adapting(2.0, dropout=0.3, key=k))))
    samples = np.asarray(drop(jax.random.split(jax.random.key(1), 20000)))
    assert np.std(samples, axis=0).min() > 0.1  # masks are drawn
    error = np.abs(samples.mean(axis=0) - plain) / (np.std(samples, axis=0) / np.sqrt(len(samples)))
    assert error.max() < 5.0  # unbiased: within 5 standard errors everywhere
    zero_b = {**w, "q_lora_b": jnp.zeros_like(w["q_lora_b"])}
    dropped = project("bth,hnd->btnd", x, zero_b, "q", Adapting(2.0, dropout=0.3, key=jax.random.key(2)))
    np.testing.assert_array_equal(np.asarray(dropped), np.asarray(jnp.einsum("bth,hnd->btnd", x, w["q"])))

    model = _adapted(base_dir)
    _randomise_b(model)
    eval_logits = np.asarray(model(jnp.asarray(TOKENS)))
    model.config = model.backbone.config = dataclasses.replace(model.config, lora=dataclasses.replace(
        model.config.lora, dropout=0.5))
    np.testing.assert_array_equal(np.asarray(model(jnp.asarray(TOKENS))), eval_logits)  # no key: no dropout
    key = training_key(jnp.int32(3), jnp.asarray(TOKENS))
    trained = np.asarray(model(jnp.asarray(TOKENS), dropout_key=key))
    assert np.max(np.abs(trained - eval_logits)) > 1e-2
    np.testing.assert_array_equal(np.asarray(model(jnp.asarray(TOKENS), dropout_key=key)), trained)
    for other in (training_key(jnp.int32(4), jnp.asarray(TOKENS)), training_key(jnp.int32(3), jnp.asarray(TOKENS[::-1]))):
        assert np.max(np.abs(np.asarray(model(jnp.asarray(TOKENS), dropout_key=other)) - trained)) > 1e-3

    save_adapter(model, tmp_path / "adapter", base_model=str(base_dir))
    assert read_adapter_config(tmp_path / "adapter").dropout == 0.5
    with pytest.raises(ConfigError, match="model.lora.dropout"):
        load_config("configs/quickstart.yaml", ["model.lora={dropout: 1.0}"], schema=TrainConfig)


def test_the_training_steps_draw_the_adapters_dropout():
    """PPO (policy and critic) and SFT steps on a LoRA model with dropout: the same step twice is
    the same update (the masks come from the step and the batch), and it differs from the update
    without dropout (at B = 0 dropout shows in B's gradient only); θ_old scoring draws none."""
    from ppo_setup import STEP_CONFIG, TINY, scored_batch, step_optimizer

    from opd_jax.core import PolicyState, ppo_step, sft_step
    from opd_jax.models import Decoder

    def ppo_update(dropout):
        config = dataclasses.replace(TINY, lora=LoraConfig(rank=2, alpha=4.0, dropout=dropout))
        policy = Decoder(config, rngs=nnx.Rngs(0))
        critic = ValueModel.from_policy(policy, head_init="small", key=jax.random.key(1), scale=0.3)
        state = PPOState.create(policy, critic, step_optimizer(), step_optimizer())
        batch = scored_batch(state)
        return batch, ppo_step(state, batch, config=STEP_CONFIG)[0], state

    batch0, plain, _ = ppo_update(0.0)
    batch, dropped, state = ppo_update(0.5)
    np.testing.assert_array_equal(np.asarray(batch.logp_old), np.asarray(batch0.logp_old))  # scoring: none
    again = ppo_step(state, batch, config=STEP_CONFIG)[0]
    for part in ("policy", "critic"):
        b_of = lambda s, p=part: np.asarray(getattr(s, p)["backbone"]["layers"]["q_lora_b"][...])  # noqa: E731
        np.testing.assert_array_equal(b_of(again), b_of(dropped))
        assert np.max(np.abs(b_of(dropped) - b_of(plain))) > 1e-6, part

    policy = Decoder(dataclasses.replace(TINY, lora=LoraConfig(rank=2, alpha=4.0, dropout=0.5)), rngs=nnx.Rngs(0))
    sft = PolicyState.create(policy, step_optimizer())
    first, second = (sft_step(sft, batch)[0] for _ in range(2))
    np.testing.assert_array_equal(*(np.asarray(s.params["backbone"]["layers"]["q_lora_b"][...]) for s in (first, second)))


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


def test_a_qlora_glm5_run_killed_during_a_save_resumes_exactly(tmp_path):
    """The loop tests' run (a MoE policy with routing replay, sharded over 8 devices, a critic and a
    KL reference; no evaluation, episodes or warm start) as a GLM-5-shaped policy (latent
    attention, DSA's indexers with index replay) with adapters on every projection and routed
    expert over an int4 base (QLoRA): SIGKILL while saving step 4, resume; the parameters (the base
    still int4) and optimizer states (adapters only) equal an uninterrupted run's."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from train_loop_settings import GLM5, RESUME_ARGS, TINY, like_state

    from opd_jax.models.quant import QuantizedWeight
    from opd_jax.train import train
    from opd_jax.train.checkpoint import Checkpoints
    from opd_jax.train.metrics import read_metrics

    qlora = [*TINY, *RESUME_ARGS, *GLM5, "algorithm.ppo.index_replay=true", "steps=4",
             "model.lora={rank: 4, alpha: 8, base_quantization: {kind: int4, block_size: 16}}",
             # what the loop tests' run does beside (evaluations, episodes, a warm start) is theirs to test
             "logging.eval_at_start=false", "logging.eval_every=100", "sft.steps=0",
             "data.train=[{builtin: max, params: {hi: 9, min_len: 3, max_len: 3}}]"]
    straight = train(load_config(None, [*qlora, f"logging.run_dir={tmp_path / 'straight'}"]))
    # without the persistent compilation cache: this run's programs, loaded from it on 8 simulated CPU
    # devices, stalled in XLA:CPU's collectives past their 40 s timeout (jax 0.10.2; compiled, they run)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    killed = subprocess.run([sys.executable, str(Path(__file__).with_name("interrupt_at.py")), "kill", "train", *qlora,
                             f"logging.run_dir={tmp_path / 'killed'}"], capture_output=True, text=True, timeout=1800,
                            env={**env, "COLUMNS": "1000"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = train(load_config(None, [*qlora, f"logging.run_dir={tmp_path / 'killed'}"]), resume=True)
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
        for module in ("q_a", "q_b", "kv_a", "kv_b", "o", "expert_up", "up"):  # latent attention too
            assert any(f"'{module}_lora_a'" in p for p in params), (module, params)
    a, b = states
    q = a.policy["backbone"]["layers"]["expert_up"][...]
    assert isinstance(q, QuantizedWeight) and q.q.qvalue.dtype == jnp.int4  # held and checkpointed as int4
    rows = read_metrics(straight / "metrics.jsonl")
    assert any(r.get("policy/grad_norm", 0) > 0 for r in rows)
    assert any("policy/dsa/flip_frac" in r for r in rows)  # trained on the engine's keys (index replay)
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    adapters = trainable(a.policy)
    assert nbytes(adapters) < nbytes(a.policy) / 2
    assert 2 * nbytes(adapters) <= nbytes(a.policy_opt) < 2 * nbytes(adapters) + 64  # Adam's moments: adapters only
    for x, y in zip(jax.tree.leaves((a.policy, a.critic, a.policy_opt, a.critic_opt, a.reference)),
                    jax.tree.leaves((b.policy, b.critic, b.policy_opt, b.critic_opt, b.reference)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_engine_serves_a_qlora_policy_as_base_and_adapters_and_a_refit_moves_the_adapters(base_dir):
    """A QLoRA policy (int8 base, trained adapters) in the embedded engine: the first update's
    model is the dequantized base with the adapters kept, and gives the trainer's logits (the
    quantized base is a different function from the full-precision one). A refit after more
    training moves the adapters alone: the engine's base arrays are the very ones it held, and it
    then gives the trainer's new logits, which the merged export gives too. An engine that
    quantizes its weights (it quantizes the merged ones) is sent the merged model instead."""
    from opd_jax.config.schema import QuantizationSection, RolloutSection
    from opd_jax.models.lora import merged_params
    from opd_jax.models.quant import QuantScheme, quantize_decoder
    from opd_jax.models.weights import build_from_params
    from opd_jax.sampling import EmbeddedEngine, Sampler
    from opd_jax.train.engines import weight_update

    model = _adapted(base_dir)
    _randomise_b(model)
    full = np.asarray(model(jnp.asarray(TOKENS)))
    quantize_decoder(model, QuantScheme("int8", "channel"))
    trainer = np.asarray(model(jnp.asarray(TOKENS)))
    assert np.max(np.abs(trainer - full)) > 1e-4
    first = weight_update(RolloutSection(), model.config, nnx.state(model, nnx.Param), None, 0)
    sampler = Sampler(first.model())
    served = lambda: nnx.merge(sampler.graphdef, sampler.state)  # noqa: E731
    assert served().config.lora is not None
    _close(np.asarray(served()(jnp.asarray(TOKENS))), trainer, rtol=1e-5)

    base = lambda: jax.tree.leaves(nnx.state(served(), nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))  # noqa: E731
    held = base()
    _randomise_b(model, seed=7)  # as after more training steps
    trainer = np.asarray(model(jnp.asarray(TOKENS)))
    refit = weight_update(RolloutSection(), model.config, nnx.state(model, nnx.Param), None, 1)
    refit = dataclasses.replace(refit, model=None)  # the engine must not ask for the whole model
    asyncio.run(EmbeddedEngine(sampler).update_weights(refit))
    assert all(a is b for a, b in zip(base(), held, strict=True)) and sampler.weight_version == 1
    _close(np.asarray(served()(jnp.asarray(TOKENS))), trainer, rtol=1e-5)
    # and decoding through its KV cache, the adapters on
    engine, (B, T) = served(), TOKENS.shape
    cache = KVCache.empty(engine.config, B, T, "float32")
    _, cache, _ = engine.decode(jnp.asarray(TOKENS[:, :-1]), cache, positions=jnp.tile(jnp.arange(T - 1), (B, 1)))
    last, _, _ = engine.decode(jnp.asarray(TOKENS[:, -1:]), cache, positions=jnp.full((B, 1), T - 1))
    _close(np.asarray(last), trainer[:, -1], rtol=1e-5)
    config, pure = merged_params(model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    _close(np.asarray(build_from_params(type(model), config, pure)(jnp.asarray(TOKENS))), trainer, rtol=1e-5)

    quantized = weight_update(RolloutSection(quantization=QuantizationSection(kind="int8")), model.config,
                              nnx.state(model, nnx.Param), None, 2)
    assert quantized.adapters is None and quantized.model().config.lora is None
    with pytest.raises(ValueError, match="adapters of the names, shapes and dtypes"):
        sampler.update_adapters({"backbone": {"layers": {}}}, 3)


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
