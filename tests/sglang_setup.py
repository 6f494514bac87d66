"""The real sglang-jax server for the bridge tests: a tiny Llama (head_dim 128, as sglang-jax's
CPU path needs) saved with opd_jax's own save_model, served from the environment that
tools/sglang_jax_env.py builds (the test command builds it first; a missing one is built here)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opd_jax.core.distributions import token_logprobs
from opd_jax.models import Decoder, save_model
from opd_jax.models.char_tokenizer import char_tokenizer
from opd_jax.models.config import ModelConfig
from rollout_bridge import sglang_jax
from rollout_bridge.pipe import LoopThread
from rollout_bridge.servers import LaunchSpec, ServerGroup

ROOT = Path(__file__).resolve().parent.parent
# no EOS anywhere (model config, generation config, tokenizer): SGLang stops at a model's EOS
# whatever the request says, and these tests need rollouts of exactly the requested length
TOKENIZER = dataclasses.replace(char_tokenizer(), eos_token=None)
CONFIG = ModelConfig(family="llama", vocab_size=TOKENIZER.vocab_size, hidden_size=256, intermediate_size=512,
                     num_layers=2, num_heads=2, num_kv_heads=1, head_dim=128, max_position_embeddings=512)


def sglang_python(routed_experts: bool = False) -> Path:
    try:
        return sglang_jax.python(routed_experts=routed_experts)
    except FileNotFoundError:
        flags = ["--routed-experts", str(sglang_jax.ROUTED_EXPERTS_VENV)] if routed_experts else \
            [str(sglang_jax.DEFAULT_VENV)]
        subprocess.run([sys.executable, str(ROOT / "tools" / "sglang_jax_env.py"), *flags], check=True)
        return sglang_jax.python(routed_experts=routed_experts)


def tiny_model(seed: int) -> Decoder:
    return Decoder(CONFIG, rngs=nnx.Rngs(seed))


def save_tiny(directory: Path, seed: int) -> Path:
    save_model(tiny_model(seed), directory, TOKENIZER)
    return directory


def launch_spec(log_dir: Path, routed_experts: bool = False, **command_kwargs) -> LaunchSpec:
    """sglang-jax 0.0.2 (patched), or with routed_experts the 0.1 server that returns them."""
    env = sglang_jax.ROUTED_EXPERTS_ENV if routed_experts else sglang_jax.ENV
    return LaunchSpec(tuple(sglang_jax.command(sglang_python(routed_experts), routed_experts=routed_experts,
                                               **command_kwargs)),
                      env=tuple(env.items()), startup_timeout_s=600, log_dir=log_dir)


@contextlib.contextmanager
def running_servers(model_dir: Path, log_dir: Path, **command_kwargs):
    """A started ServerGroup, supervised on its own event loop thread; yields (group, thread)."""
    group = ServerGroup(launch_spec(log_dir, **command_kwargs), model_dir)
    thread = LoopThread("sglang-servers")
    try:
        thread.run(group.start())
        yield group, thread
    finally:
        thread.run(group.close(), timeout=120)
        thread.stop_loop()


@functools.partial(jax.jit, static_argnames="graphdef")
def _forward_logprobs(graphdef, state, tokens, temperature):
    model = nnx.merge(graphdef, state)
    logits = model(tokens, positions=jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape))
    return token_logprobs(logits.astype(jnp.float32) / temperature, tokens)[0]


def trainer_logprobs(model: Decoder, prompt: tuple[int, ...], output: tuple[int, ...], temperature: float) -> np.ndarray:
    """What the trainer computes for a rollout: log softmax(logits / T) of each output token
    (T = 0, greedy, reports T = 1). Right-padded to 512 tokens, so one compiled forward serves
    every rollout: causal attention keeps the padding out of the real positions."""
    ids = list(prompt) + list(output)
    tokens = np.zeros((1, 512), np.int32)
    tokens[0, :len(ids)] = ids
    graphdef, state = nnx.split(model)
    logp = _forward_logprobs(graphdef, state, jnp.asarray(tokens), jnp.float32(temperature or 1.0))
    return np.asarray(logp[0, len(prompt):len(ids)])


async def collect(engine, requests) -> list:
    """Every completion of one engine.stream call, in completion order."""
    return [c async for c in engine.stream(requests)]


def wait_for_tokens(engine, request_ids, timeout: float = 60.0) -> None:
    """Until each request has streamed at least one token (so an abort or pause cuts it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        flights = [engine._flights.get(i) for i in request_ids]
        if all(f is not None and f.partial is not None and f.partial.output_ids for f in flights):
            return
        time.sleep(0.05)
    raise AssertionError("requests did not start streaming")
