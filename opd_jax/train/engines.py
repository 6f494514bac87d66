"""The rollout engine a config asks for, behind rollout_bridge's protocol: the embedded sampler,
or SGLang servers (running ones, or ones launched and supervised here). Also the weight update
the loop hands to whichever it is."""

from __future__ import annotations

from pathlib import Path

from flax import nnx

from opd_jax.config import RolloutSection
from opd_jax.models import Decoder, ModelConfig, Tokenizer, save_model
from opd_jax.sampling import EmbeddedEngine, Sampler
from opd_jax.train.build import engine_model
from rollout_bridge.pipe import EngineThread
from rollout_bridge.protocol import WeightUpdate
from rollout_bridge.servers import LaunchSpec, ServerGroup
from rollout_bridge.sglang_engine import SGLangEngine


def weight_update(rollout: RolloutSection, model_config: ModelConfig, params: nnx.State, tokenizer: Tokenizer,
                  version: int) -> WeightUpdate:
    """Version `version` of the policy, in the engine's dtype, in memory or as an HF directory."""
    def model() -> Decoder:
        return engine_model(model_config, params, rollout.dtype, noise=rollout.inject_weight_noise, version=version)

    return WeightUpdate(version, model=model, save_hf=lambda directory: save_model(model(), directory, tokenizer))


def make_engine(rollout: RolloutSection, seed: int, update: WeightUpdate, *, max_cache_len: int, pad_id: int,
                refit_dir: Path) -> EngineThread:
    """An engine serving `update` (the policy the run starts from)."""
    if rollout.engine == "embedded":
        sampler = Sampler(update.model(), max_cache_len=max_cache_len, pad_id=pad_id, weight_version=update.version)
        return EngineThread(EmbeddedEngine(sampler, seed=seed))
    options = rollout.sglang
    servers = None
    thread: EngineThread | None = None
    try:
        if rollout.launch is not None:
            launch = rollout.launch
            initial = (refit_dir / f"v{update.version}").resolve()
            update.save_hf(initial)
            servers = ServerGroup(LaunchSpec(tuple(launch.command), launch.num_servers, launch.host,
                                             tuple(launch.ports), tuple(launch.env.items()), launch.startup_timeout_s,
                                             refit_dir.parent / "sglang_logs"), initial)
        engine = SGLangEngine(rollout.urls, servers=servers, stream=options.stream,
                              request_timeout_s=options.request_timeout_s, max_retries=options.max_retries,
                              max_concurrency=options.max_concurrency, refit=options.refit, refit_dir=refit_dir,
                              interrupted=rollout.interrupted, weight_version=update.version)
        thread = EngineThread(engine)
        if servers is not None:
            thread.run(servers.start())
        else:  # servers someone else started: make them serve this run's policy
            thread.update_weights(update)
        return thread
    except BaseException:
        if thread is not None:
            close_engine(thread)
        raise


def close_engine(thread: EngineThread) -> None:
    servers = getattr(thread.engine, "servers", None)
    try:
        if servers is not None:
            thread.run(servers.close(), timeout=120)
    finally:
        thread.close()


def engine_metrics(thread: EngineThread) -> dict[str, float]:
    stats = getattr(thread.engine, "stats", None)
    if stats is None:
        return {}
    servers = getattr(thread.engine, "servers", None)
    out = {"rollout/retries": float(stats.retries), "rollout/interrupted": float(stats.interrupted),
           "rollout/failed_requests": float(stats.failures), "rollout/refit_s_total": stats.refit_s}
    if servers is not None:
        out["rollout/server_crashes"] = float(servers.crashes())
    return out
