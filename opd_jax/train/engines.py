"""The rollout engine a config asks for, behind rollout_bridge's protocol: the embedded sampler,
or SGLang servers (running ones, or ones launched and supervised here). SGLang clients are built
from a config section in one place (`sglang_engine`), for the policy's rollouts and for the
merge's teachers alike. Also the weight update the loop hands to whichever engine it is."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flax import nnx

from opd_jax.config import RolloutSection
from opd_jax.config.schema import SGLangClientSection
from opd_jax.models import Decoder, ModelConfig, Tokenizer, save_model
from opd_jax.sampling import EmbeddedEngine, Sampler
from opd_jax.train.build import EngineNumerics, engine_model
from rollout_bridge.pipe import EngineThread
from rollout_bridge.protocol import WeightUpdate
from rollout_bridge.servers import LaunchSpec, ServerGroup
from rollout_bridge.sglang_api import RoutingLayout
from rollout_bridge.sglang_engine import SGLangEngine


def weight_update(rollout: RolloutSection, model_config: ModelConfig, params: nnx.State, tokenizer: Tokenizer,
                  version: int) -> WeightUpdate:
    """Version `version` of the policy, in the engine's dtype, in memory or as an HF directory."""
    def model() -> Decoder:
        return engine_model(model_config, params, EngineNumerics.of(rollout), noise=rollout.inject_weight_noise,
                            version=version)

    return WeightUpdate(version, model=model, save_hf=lambda directory: save_model(model(), directory, tokenizer))


def sglang_engine(section: SGLangClientSection, urls: Sequence[str], *, model_dir: Path | None, log_dir: Path,
                  **options: Any) -> EngineThread:
    """An SGLang client (not started: call `.start()`) of the servers at `urls`, or of servers it
    launches on `model_dir` as `section.launch` says (logs in `log_dir`); `options` are the
    engine's own (stream, refit, ...)."""
    servers = None
    if section.launch is not None:
        launch = section.launch
        servers = ServerGroup(LaunchSpec(tuple(launch.command), launch.num_servers, launch.host, tuple(launch.ports),
                                         tuple(launch.env.items()), launch.startup_timeout_s, log_dir), model_dir)
    return EngineThread(SGLangEngine(urls, servers=servers, request_timeout_s=section.request_timeout_s,
                                     max_retries=section.max_retries, max_concurrency=section.max_concurrency,
                                     **options))


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
        sampler = Sampler(update.model(), max_cache_len=max_cache_len, pad_id=pad_id, weight_version=update.version,
                          kv_cache_dtype=rollout.kv_cache_dtype)
        return EngineThread(EmbeddedEngine(sampler, seed=seed))
    section = rollout.sglang
    initial = None
    if section.launch is not None:
        initial = (refit_dir / f"v{update.version}").resolve()
        update.save_hf(initial)
    thread = sglang_engine(section, section.urls, model_dir=initial, log_dir=refit_dir.parent / "sglang_logs",
                           stream=section.stream, refit=section.refit, refit_dir=refit_dir,
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
