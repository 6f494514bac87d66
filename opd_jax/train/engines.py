"""The rollout engine a config asks for, behind rollout_bridge's protocol: the embedded sampler,
or SGLang servers (running ones, or ones launched and supervised here). SGLang clients are built
from a config section in one place (`sglang_engine`), for the policy's rollouts and for the
merge's teachers alike. Also the weight update the loop hands to whichever engine it is."""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flax import nnx

from opd_jax.config import ConfigError, RolloutSection
from opd_jax.config.schema import SGLangClientSection
from opd_jax.models import Decoder, ModelConfig, Tokenizer, save_model
from opd_jax.sampling import EmbeddedEngine, Sampler
from opd_jax.sampling.prefix_cache import prefix_tokens
from opd_jax.train.build import EngineNumerics, engine_adapters, engine_model, serves_adapters
from rollout_bridge.pipe import EngineThread
from rollout_bridge.protocol import WeightUpdate
from rollout_bridge.servers import LaunchSpec, ServerGroup
from rollout_bridge.sglang_api import RoutingLayout
from rollout_bridge.sglang_engine import SGLangEngine


def weight_update(rollout: RolloutSection, model_config: ModelConfig, params: nnx.State, tokenizer: Tokenizer,
                  version: int, *, seed: int = 0) -> WeightUpdate:
    """Version `version` of the policy, in the engine's dtype, in memory or as an HF directory (a
    LoRA policy's merged), and a LoRA policy's adapters alone where the engine serves them. Weight
    noise (rollout.inject_weight_noise) is drawn from the run's `seed` and the version."""
    numerics = EngineNumerics.of(rollout)

    def model() -> Decoder:
        return engine_model(model_config, params, numerics, noise=rollout.inject_weight_noise, version=version,
                            seed=seed)

    adapters = None
    if serves_adapters(model_config, numerics, rollout.inject_weight_noise):
        adapters = functools.partial(engine_adapters, params, numerics)
    return WeightUpdate(version, model=model, save_hf=lambda directory: save_model(model(), directory, tokenizer),
                        adapters=adapters)


# sglang-jax's online weight-only quantization configs (--quantization-config-path, built in from
# 0.1): per-channel fp8 and int8, 128 x 128 fp8 blocks. It has no int4 for an unquantized
# checkpoint, and its KV cache is the model's dtype or bf16 only (its --kv-cache-dtype lists fp8
# choices that its model runner refuses).
_SGLANG_QUANTIZATION = {("fp8", "channel", None): "fp8.yaml", ("fp8", "block", 128): "fp8_block_128_dynamic.yaml",
                        ("int8", "channel", None): "int8.yaml"}
_SGLANG_KV_CACHE = {"bfloat16": "bf16"}


def sglang_server_flags(rollout: RolloutSection) -> tuple[str, ...]:
    """What the engine settings add to the launch command of SGLang servers; a setting sglang-jax
    cannot serve is a ConfigError naming the key."""
    flags: list[str] = []
    scheme = rollout.quantization.scheme()
    if scheme is not None:
        key = (scheme.kind, scheme.scales, scheme.block if scheme.scales != "channel" else None)
        if key not in _SGLANG_QUANTIZATION:
            served = ", ".join(f"{k} {s}" + (f" {b}" if b else "") for k, s, b in _SGLANG_QUANTIZATION)
            raise ConfigError(f"rollout.quantization: sglang-jax servers cannot quantize weights as {scheme} "
                              f"(they serve: {served})")
        flags += ["--quantization-config-path", _SGLANG_QUANTIZATION[key]]
    if rollout.kv_cache_dtype is not None:
        if rollout.kv_cache_dtype not in _SGLANG_KV_CACHE:
            raise ConfigError(f"rollout.kv_cache_dtype: sglang-jax servers keep their KV cache in the model's dtype "
                              f"or bfloat16 only, not {rollout.kv_cache_dtype}")
        flags += ["--kv-cache-dtype", _SGLANG_KV_CACHE[rollout.kv_cache_dtype]]
    return tuple(flags)


def check_server_flags(command: Sequence[str], flags: Sequence[str]) -> None:
    """The launch command's server takes each flag of `flags` (its --help lists it): one line
    naming the flag before anything is launched."""
    wanted = [f for f in flags if f.startswith("--")]
    if not wanted:
        return
    probe = [part.format(model_path="/nonexistent", host="127.0.0.1", port="0") for part in command] + ["--help"]
    try:
        shown = subprocess.run(probe, capture_output=True, text=True, timeout=180).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"rollout.sglang.launch.command: could not ask the server for its options ({e})") from None
    missing = [f for f in wanted if f not in shown]
    if missing:
        raise ConfigError(f"rollout.sglang.launch.command: this server has no {', '.join(missing)} option (the "
                          f"engine settings rollout.quantization / rollout.kv_cache_dtype need it); sglang-jax serves "
                          f"weight quantization from release 0.1 on")


INITIAL_WEIGHTS = "initial"  # run_dir/refit/initial: the policy a run starts from, for servers to boot on


def sglang_engine(section: SGLangClientSection, urls: Sequence[str], *, model_dir: Path | None, log_dir: Path,
                  server_flags: Sequence[str] = (), **options: Any) -> EngineThread:
    """An SGLang client (not started: call `.start()`) of the servers at `urls`, or of servers it
    launches on `model_dir` as `section.launch` says (logs in `log_dir`), their command extended
    by `server_flags`; `options` are the engine's own (stream, refit, ...)."""
    servers = None
    if section.launch is not None:
        launch = section.launch
        servers = ServerGroup(LaunchSpec((*launch.command, *server_flags), launch.num_servers, launch.host,
                                         tuple(launch.ports),
                                         tuple(launch.env.items()), launch.startup_timeout_s, log_dir), model_dir)
    return EngineThread(SGLangEngine(urls, servers=servers, request_timeout_s=section.request_timeout_s,
                                     max_retries=section.max_retries, max_concurrency=section.max_concurrency,
                                     wait_for_servers_s=section.wait_for_servers_s, **options))


def routing_layout(config: ModelConfig) -> RoutingLayout | None:
    """Where a MoE policy's experts sit in an SGLang server's routed_experts (None: dense)."""
    if config.moe is None:
        return None
    return RoutingLayout(config.num_layers, tuple(config.moe_layers), config.moe.experts_per_token)


def make_engine(rollout: RolloutSection, seed: int, update: WeightUpdate, *, max_cache_len: int, pad_id: int,
                refit_dir: Path, routing: RoutingLayout | None = None) -> EngineThread:
    """A started engine serving `update` (the policy the run starts from). `routing`: SGLang
    servers are asked for the experts of every token (the embedded engine always records them)."""
    if rollout.engine == "embedded":
        model = update.model()
        sampler = Sampler(model, max_cache_len=max_cache_len, pad_id=pad_id, weight_version=update.version,
                          kv_cache_dtype=rollout.kv_cache_dtype, slots=rollout.decode_slots,
                          prefix_cache_tokens=prefix_tokens(model.config, rollout.kv_cache_dtype or rollout.dtype,
                                                            rollout.prefix_cache_gib * 2**30))
        return EngineThread(EmbeddedEngine(sampler, seed=seed))
    section = rollout.sglang
    initial = None
    if section.launch is not None:
        initial = (refit_dir / f"v{update.version}").resolve()
        update.save_hf(initial)
    elif not (refit_dir / INITIAL_WEIGHTS / "config.json").exists():
        # running servers need a model of the policy's shape to boot on: a cluster's (`opd-jax k8s
        # render`) wait for this one, then serve the run's weights from the first refit on
        update.save_hf(refit_dir / INITIAL_WEIGHTS)
    flags = sglang_server_flags(rollout)
    if section.launch is not None:
        check_server_flags(section.launch.command, flags)
    thread = sglang_engine(section, section.urls, model_dir=initial, log_dir=refit_dir.parent / "sglang_logs",
                           server_flags=flags,
                           stream=section.stream, stream_interval=section.stream_interval, refit=section.refit,
                           refit_dir=refit_dir,
                           interrupted=rollout.interrupted, weight_version=update.version,
                           routing=routing)
    try:
        thread.start().result()
        if section.launch is None:  # servers someone else started: make them serve this run's policy
            thread.update_weights(update)
        return thread
    except BaseException:
        thread.close()
        raise
