"""sglang-jax 0.1 as a MoE rollout engine: a tiny Qwen3-MoE saved by opd_jax, served with
--enable-return-routed-experts and FP8 weights (the flags the engine settings add); the bridge
asks for the experts of every token and hands them over as [tokens, MoE layers, k], and the
server's FP8 (per-channel, weight-only) is opd_jax's own FP8 engine to the last digit.

What the server computes is not quite the trainer's function: sglang-jax 0.1.0rc0's CPU path
agrees with opd_jax (itself checked against transformers) on the first position only; beyond it,
its attention differs (logprobs off by up to ~0.2), so its routing agrees with the trainer's for
under half of the later token-layers. The tests hold the server to what it does compute: the
first token's experts and logprob exactly (those of opd_jax's FP8 engine), every layer and slot
in place; the rest far above the 1/28 a wrong layout would give. (Not streamed: 0.1.0rc0's stream events repeat earlier
logprobs, which the bridge rejects; routed experts come with the final response anyway.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from sglang_setup import TOKENIZER, running_servers, sglang_python, trainer_logprobs

from opd_jax.config.schema import QuantizationSection, RolloutSection
from opd_jax.models import Decoder, save_model
from opd_jax.models.config import ModelConfig
from opd_jax.models.moe import MoEConfig
from opd_jax.train.build import EngineNumerics, engine_model
from opd_jax.train.engines import check_server_flags, routing_layout, sglang_server_flags
from rollout_bridge.pipe import EngineThread
from rollout_bridge.records import Failure, Request, Rollout, SamplingParams
from rollout_bridge.sglang_api import RoutingLayout
from rollout_bridge.sglang_engine import SGLangEngine

CONFIG = ModelConfig(family="qwen3_moe", vocab_size=TOKENIZER.vocab_size, hidden_size=256, intermediate_size=512,
                     num_layers=3, num_heads=2, num_kv_heads=2, head_dim=128, max_position_embeddings=512,
                     moe=MoEConfig(num_experts=8, experts_per_token=2, intermediate_size=128, dense_layers=(0,),
                                   norm_topk_prob=True))
MODEL = Decoder(CONFIG, rngs=nnx.Rngs(0))
FP8 = RolloutSection(quantization=QuantizationSection(kind="fp8"))
ENGINE = engine_model(CONFIG, nnx.state(MODEL, nnx.Param), EngineNumerics.of(FP8))  # what the server serves
PROMPTS = [tuple(range(3 + i, 9 + 2 * i)) for i in range(6)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_moe")
    save_model(MODEL, root / "model", TOKENIZER)
    with running_servers(root / "model", root / "logs", routed_experts=True, max_running_requests=8,
                         extra=sglang_server_flags(FP8)) as (group, _):
        yield group.urls[0]


@jax.jit
def _routing(state, tokens):
    _, info = nnx.merge(GRAPHDEF, state)(tokens, positions=jnp.arange(tokens.shape[1])[None], return_routing=True)
    return info.ids


GRAPHDEF, STATE = nnx.split(ENGINE)


def trainer_routing(tokens: tuple[int, ...]) -> np.ndarray:
    """[tokens, MoE layers, k]: the experts opd_jax's FP8 engine picks for each token (right-padded to
    one length, so one compiled forward serves all; causal attention keeps padding out)."""
    padded = np.zeros((1, 64), np.int32)
    padded[0, :len(tokens)] = tokens
    return np.asarray(_routing(STATE, jnp.asarray(padded))[0, :len(tokens)])


def generate(server, layout, prompts, max_new_tokens: int) -> list:
    thread = EngineThread(SGLangEngine([server], stream=False, routing=layout))
    try:
        return thread.generate([Request(p, SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0))
                                for p in prompts])
    finally:
        thread.close()


def test_the_first_tokens_experts_and_logprob_are_those_of_opd_jax_fp8_engine(server):
    """One-token prompts: the server routes each through every MoE layer (top-2 of 8) as opd_jax's
    FP8 engine does, slot by slot, and samples the next token with its logprob, which the
    unquantized model does not give."""
    rollouts = generate(server, routing_layout(CONFIG), [(t,) for t in range(3, 19)], 1)
    unquantized = []
    for r in rollouts:
        assert isinstance(r, Rollout), r
        ours = trainer_routing(r.prompt_ids + r.output_ids)
        np.testing.assert_array_equal(np.sort(r.routed_experts[0], -1), np.sort(ours[0], -1))
        assert (r.routed_experts[1] == -1).all()
        np.testing.assert_allclose(r.output_logprobs, trainer_logprobs(ENGINE, r.prompt_ids, r.output_ids, 1.0),
                                   atol=1e-5)
        unquantized.append(abs(r.output_logprobs[0] - trainer_logprobs(MODEL, r.prompt_ids, r.output_ids, 1.0)[0]))
    assert max(unquantized) > 1e-3  # FP8 moved the logprobs: the quantization is real


def test_every_token_of_a_rollout_comes_with_its_experts(server):
    layout = routing_layout(CONFIG)
    assert layout.moe_layers == (1, 2)
    rollouts = generate(server, layout, PROMPTS, 8)
    same = total = 0
    for r in rollouts:
        assert isinstance(r, Rollout), r
        tokens = r.prompt_ids + r.output_ids
        assert r.routed_experts.shape == (len(tokens), 2, 2)
        assert (r.routed_experts[-1] == -1).all() and (r.routed_experts[:-1] >= 0).all()
        ours = trainer_routing(tokens)[:-1]
        agree = (np.sort(ours, -1) == np.sort(r.routed_experts[:-1], -1)).all(-1)
        same, total = same + agree.sum(), total + agree.size
    assert same / total >= 0.3, f"only {same} of {total} token-layers routed as the trainer routes them"


def test_a_layout_that_is_not_the_servers_is_named(server):
    """A layout that disagrees with the served model is a Failure that says so."""
    (failure,) = generate(server, RoutingLayout(4, (1, 2), 2), PROMPTS[:1], 3)
    assert isinstance(failure, Failure) and "is the server's model the policy?" in failure.error


def test_engine_settings_become_server_flags_or_a_named_error():
    from opd_jax.config import ConfigError
    from rollout_bridge import sglang_jax

    assert sglang_server_flags(FP8) == ("--quantization-config-path", "fp8.yaml")
    bf16_kv = RolloutSection(kv_cache_dtype="bfloat16", quantization=QuantizationSection(kind="int8"))
    assert sglang_server_flags(bf16_kv) == ("--quantization-config-path", "int8.yaml", "--kv-cache-dtype", "bf16")
    with pytest.raises(ConfigError, match="rollout.quantization: sglang-jax servers cannot quantize weights as int4"):
        sglang_server_flags(RolloutSection(quantization=QuantizationSection(kind="int4")))
    with pytest.raises(ConfigError, match="rollout.kv_cache_dtype: .* not float8_e4m3fn"):
        sglang_server_flags(RolloutSection(kv_cache_dtype="float8_e4m3fn"))
    # asked of the server itself: 0.1 takes the flag, 0.0.2 does not have it
    flags = sglang_server_flags(FP8)
    check_server_flags(sglang_jax.command(sglang_python(routed_experts=True), routed_experts=True), flags)
    with pytest.raises(ConfigError, match="this server has no --quantization-config-path option"):
        check_server_flags(sglang_jax.command(sglang_python()), flags)
