"""`opd-jax mismatch`: the census of an engine's mismatch. For each engine of `census.engines` (or
the config's own) and each seed, the run's own rollout machinery (`RolloutSession`: the embedded
engine at its precision, quantization and KV dtype, MoE with its routing recorded, or SGLang
servers) samples `census.samples` responses to the config's prompts, and the trainer (the
config's model at its precision, with routing replay when the config replays) scores the same
tokens at the sampling temperature. A DSA model (GLM-5) is scored twice, attending its own keys
and the engine's (index replay), and the keys each side chose are kept for the index flips. The
per-token log-probs go to `figures` (and, with --dump, to `tokens/ENGINE_seedN.npz`); `report`
writes mismatch.json, mismatch.md and the plots."""

from __future__ import annotations

import difflib
import functools
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from opd_jax.config import ConfigError, RolloutSection, TrainConfig, scoring_temperature
from opd_jax.core import sequence_logprobs
from opd_jax.mismatch.figures import Tokens, census_figures
from opd_jax.train import RolloutSession, build_model, check_engine, progress

_LOGITS_BYTES = 2**30  # the trainer's logits per scoring pass


def engine_kind(rollout: RolloutSection, trainer_dtype: str) -> str:
    """What the engine is next to the trainer: the same code at its own numerics, or another stack."""
    if rollout.engine == "sglang":
        return "different kernel stack (SGLang server)"
    parts = [rollout.dtype] + ([str(rollout.quantization.scheme())] if rollout.quantization.scheme() else [])
    if rollout.kv_cache_dtype:
        parts.append(f"KV {rollout.kv_cache_dtype}")
    if rollout.inject_weight_noise:
        parts.append(f"weight noise {rollout.inject_weight_noise:g}")
    same = parts == [trainer_dtype]
    return "same code, same numerics" if same else f"same code, {', '.join(parts)}"


def sample_tokens(config: TrainConfig, rollout: RolloutSection, seed: int, policy: Any, tokenizer: Any,
                  scratch: Path, label: str = "census") -> tuple[Tokens, dict[str, Any]]:
    """`census.samples` responses of the engine `rollout`, scored by the trainer: their tokens
    (see figures.Tokens), with the token ids and the sampling's throughput in `extra`. A progress
    bar named `label` counts the responses."""
    replay = config.algorithm.ppo.routing_replay == "r3" and policy.config.moe is not None
    session = RolloutSession(rollout=rollout, data=config.data, seed=seed, policy=policy,
                             params=nnx.state(policy, nnx.Param), tokenizer=tokenizer, run_dir=scratch,
                             record_routing=replay)
    graphdef, params = nnx.split(policy)
    score = jax.jit(functools.partial(sequence_logprobs, temperature=scoring_temperature(rollout), replay=replay,
                                      with_router=True), static_argnums=0, static_argnames="index_replay")
    replays_indices = config.algorithm.ppo.index_replay
    trainer, engine, position, sequence, ids = [], [], [], [], []
    index: dict[str, list[np.ndarray]] = {"index_engine": [], "index_own": [], "own_keys": [], "engine_keys": []}
    rows = generated = 0
    began = time.perf_counter()
    bar = progress(config.census.samples, label, unit="sample")
    try:
        while rows < config.census.samples:
            batch, _, metrics = session.next_batch(0, policy.config.vocab_size)
            generated += metrics["rollout/tokens"]
            # rows scored a few at a time: a whole batch's logits (rows × tokens × vocabulary, 7 GiB
            # for 64 SmolLM2 rows of 600 tokens) would not fit beside the engine
            rows_per_pass = max(1, _LOGITS_BYTES // (batch.tokens.shape[1] * policy.config.vocab_size * 4))
            passes = [jax.tree.map(lambda x, a=a: x[a:a + rows_per_pass], batch)
                      for a in range(0, batch.tokens.shape[0], rows_per_pass)]
            scored = [score(graphdef, params, part) for part in passes]
            logp = np.concatenate([np.asarray(s[0]) for s in scored])
            indexed = batch.indices is not None and scored[0][2] is not None and scored[0][2].index_offsets is not None
            if indexed:  # a DSA model: its own keys, and the engine's attended instead (index replay)
                own = {"index_own": np.concatenate([np.asarray(s[2].index_offsets) for s in scored]),
                       "own_keys": logp, "index_engine": np.asarray(batch.indices),
                       "engine_keys": np.concatenate([np.asarray(score(graphdef, params, part, index_replay=True)[0])
                                                      for part in passes])}
                logp = own["engine_keys"] if replays_indices else own["own_keys"]
            mask = np.asarray(batch.response_mask) > 0
            take = min(mask.shape[0], config.census.samples - rows)
            for r in range(take):
                on = np.flatnonzero(mask[r])
                trainer.append(logp[r, on])
                engine.append(np.asarray(batch.logp_infer)[r, on])
                position.append(np.arange(on.size))
                sequence.append(np.full(on.size, rows + r))
                ids.append(np.asarray(batch.tokens)[r, on])
                if indexed:
                    for name, values in own.items():
                        index[name].append(values[r, on])
            rows += take
            bar.update(take)
    finally:
        bar.close()
        session.close()
    flat = lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)  # noqa: E731
    tokens = Tokens(flat(trainer, np.float32), flat(engine, np.float32), flat(position, np.int32),
                    flat(sequence, np.int32),
                    **{name: np.concatenate(parts) for name, parts in index.items() if parts})
    return tokens, {"token_ids": flat(ids, np.int32), "seconds": time.perf_counter() - began,
                    "generated": generated}


def census_model(config: TrainConfig) -> tuple[TrainConfig, str]:
    """The model the census measures, and a note saying which: a config whose model is built fresh
    (random weights) measures the policy its run trained (logging.run_dir/hf_policy) when that run
    exported one, else its random model, said so."""
    if config.model.fresh is None:
        return config, ""
    trained = Path(config.logging.run_dir) / "hf_policy"
    if (trained / "config.json").is_file():
        model = config.model.model_copy(update={"path": str(trained), "fresh": None})
        return config.model_copy(update={"model": model}), (
            f"measuring the policy the run trained, {trained} (the config's model.fresh is a random model; "
            f"give model.path to measure another)")
    return config, (f"note: measuring model.fresh, a randomly initialised model: {trained} holds no trained "
                    f"policy (train first, or give model.path=...)")


def run_census(config: TrainConfig, out: Path, *, dump: bool = False, only: Sequence[str] | None = None,
               echo: Callable[[str], None] = print) -> dict[str, Any]:
    """The census of every engine (or those named in `only`) and seed: {"engines": {name: {"kind",
    "seeds": {seed: figures}}}, "settings": ...}; per-token dumps under out/tokens/ with `dump`."""
    engines = config.census.engine_sections(config.rollout)
    if only is not None:
        unknown = [name for name in only if name not in engines]
        if unknown:
            near = difflib.get_close_matches(unknown[0], list(engines), n=1)
            raise ConfigError(f"--engines: {', '.join(unknown)} not in census.engines ({', '.join(engines)})"
                              + (f"; did you mean {near[0]}?" if near else ""))
        engines = {name: engines[name] for name in only}
    for stale in ("tokens", "scratch"):  # an earlier (or interrupted) census's: never mixed with this one's
        shutil.rmtree(out / stale, ignore_errors=True)
    policy, tokenizer = build_model(config.model)
    for name, rollout in engines.items():  # every engine checked before any samples: nothing measured is lost
        check_engine(f"census.engines.{name}" if config.census.engines else "rollout", rollout, policy.config)
    trainer_dtype = config.model.compute_dtype or config.model.dtype
    census = config.census
    clip = (1 - config.algorithm.ppo.surrogate.eps_low, 1 + config.algorithm.ppo.surrogate.eps_high)
    result: dict[str, Any] = {"settings": {
        "samples": census.samples, "seeds": list(census.seeds), "bands": [list(b) for b in census.bands],
        "clip": list(clip), "trainer_dtype": trainer_dtype, "max_new_tokens": config.rollout.max_new_tokens,
        "temperature": config.rollout.temperature}, "engines": {}}
    for name, rollout in engines.items():
        entry = result["engines"][name] = {"kind": engine_kind(rollout, trainer_dtype), "seeds": {}}
        for seed in census.seeds:
            tokens, extra = sample_tokens(config, rollout, seed, policy, tokenizer, out / "scratch" / name,
                                          f"{name} seed {seed}")
            longest = max(rollout.max_new_tokens, int(tokens.position.max(initial=-1)) + 1)  # episodes: several turns
            figures = census_figures(tokens, bands=census.bands, clip=clip, position_bins=census.position_bins,
                                     longest=longest)
            figures["speed"] = {"generated tokens per s": extra["generated"] / max(extra["seconds"], 1e-9)}
            entry["seeds"][seed] = figures
            if dump:
                (out / "tokens").mkdir(parents=True, exist_ok=True)
                dsa = {k: getattr(tokens, k) for k in ("index_engine", "index_own", "own_keys", "engine_keys")
                       if getattr(tokens, k) is not None}
                np.savez_compressed(out / "tokens" / f"{name}_seed{seed}.npz", trainer=tokens.trainer,
                                    engine=tokens.engine, position=tokens.position, sequence=tokens.sequence,
                                    token_ids=extra["token_ids"], **dsa)
            t = figures["tokens"]
            echo(f"{name} seed {seed}: {int(t['tokens'])} tokens, |Δlogp| {t.get('abs_dlogp', float('nan')):.4f}, "
                 f"k3 KL {t.get('kl_k3', float('nan')):.2e}, phantom clip {t.get('phantom clip', float('nan')):.2%}"
                 + (f", index flips {figures['index']['flip_frac']:.2%}" if "index" in figures else ""))
    return result

