"""The supervised warm start: reference answers of the training domains, cross-entropy on the
answer tokens (and the stop token), sharded like the PPO step."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
from jax.sharding import Mesh

from opd_jax.config import EpisodeSection, SFTSection, TrainConfig
from opd_jax.core import RolloutBatch, UpdateConfig, make_optimizer
from opd_jax.core.sft import sft_step
from opd_jax.core.state import PolicyState
from opd_jax.data import Example, take, train_prompts
from opd_jax.envs import TurnCodec, episode_factory
from opd_jax.envs.episodes import demonstration
from opd_jax.models import Decoder, Tokenizer
from opd_jax.parallel import batch_shardings, batch_shards, make_mesh, shard, sharded_step, tree_shardings
from opd_jax.train import signals
from opd_jax.train.batching import packed_for, pad_rows
from opd_jax.train.build import encode_prompt, stop_ids
from opd_jax.train.console import progress, restart_clock
from opd_jax.train.episodes import episode_limits
from opd_jax.train.errors import Interrupted, RunError

# the warm start reads its own stream, so RL later sees the same prompts with or without it
_SFT_SEED_OFFSET = 7919


def demonstration_batch(examples: list[Example], tokenizer: Tokenizer, policy: Decoder, chat: bool,
                        episodes: EpisodeSection = EpisodeSection(), turn_tokens: int = 32) -> RolloutBatch:
    """Prompt + reference answer + stop token per example; the loss covers answer and stop. An
    environment's episode is played by its expert, the loss on the expert's turns."""
    eos = stop_ids(tokenizer, policy)[0]
    codec, limits = TurnCodec(tokenizer, chat, eos), episode_limits(episodes, turn_tokens)
    prompts, responses, masks = [], [], []
    for example in examples:
        if example.episode is None:
            answer = [*tokenizer.encode(example.answer, add_special_tokens=False), eos]
            prompts.append(encode_prompt(example, tokenizer, chat))
            responses.append(answer)
            masks.append([1] * len(answer))
            continue
        try:
            prompt, response, mask = demonstration(episode_factory(example.episode), codec=codec, tokenizer=tokenizer,
                                                   end_of_turn=eos, limits=limits)
        except Exception as error:  # the user's environment: whatever it raises is named with its episode
            raise RunError(f"warm start on episode {example.uid}: {type(error).__name__}: {error}") from None
        prompts.append(prompt)
        responses.append(response)
        masks.append(mask)
    tokens, attention, response = pad_rows(prompts, responses, pad_id=tokenizer.pad_token_id or 0)
    for i, (p, m) in enumerate(zip(prompts, masks)):
        response[i, len(p):len(p) + len(m)] = m
    return RolloutBatch(tokens=tokens, attention_mask=attention, response_mask=response,
                        logp_infer=np.zeros_like(response), rewards=np.zeros(len(examples), np.float32))


def warm_start(policy: Decoder, tokenizer: Tokenizer, config: TrainConfig, log_path: Path, *,
               restart_hint: str = "run the same command again") -> Decoder:
    """`config.sft.steps` supervised updates of `policy` on the training domains' reference
    answers; the loss per step goes to log_path. A SIGINT/SIGTERM (within
    `signals.stop_at_step_boundary`) stops it at a step boundary with `Interrupted`: nothing of it
    is kept, so `restart_hint` says how to start over."""
    data = config.data.model_copy(update={"seed": config.data.seed + _SFT_SEED_OFFSET})
    prompts = iter(train_prompts(data))

    def demonstrations(step: int) -> RolloutBatch:
        return demonstration_batch(take(prompts, config.sft.batch_size), tokenizer, policy, config.data.chat_template,
                                   config.rollout.episodes, config.rollout.max_new_tokens)
    return supervised_steps(policy, demonstrations, config.sft, make_mesh(config.mesh), log_path,
                            progress_bar=config.logging.progress_bar, restart_hint=restart_hint)


def supervised_steps(policy: Decoder, batches: Callable[[int], RolloutBatch], sft: SFTSection, mesh: Mesh,
                     log_path: Path, *, progress_bar: bool = True, what: str = "warm start",
                     restart_hint: str = "run the same command again") -> Decoder:
    """`sft.steps` cross-entropy updates of `policy` on the response tokens of batches(0),
    batches(1), ... (sharded over `mesh`, packed as sft.pack says); the loss per step goes to
    log_path. A SIGINT/SIGTERM stops it at a step boundary with `Interrupted` (nothing kept)."""
    state = PolicyState.create(policy, make_optimizer(sft.optimizer))
    state = shard(state, tree_shardings(state, mesh))
    step = None
    bar = progress(sft.steps, what, enabled=progress_bar)
    with log_path.open("w") as log, bar:
        for i in range(sft.steps):
            batch = packed_for(batches(i), UpdateConfig(pack=sft.pack), batch_shards(mesh))
            if step is None:
                bar.set_postfix_str("compiling the step")
                step = sharded_step(functools.partial(sft_step, router_balance_coef=sft.router_balance_coef),
                                    state, batch, mesh)
            state, metrics = step(state, shard(batch, batch_shardings(batch, mesh)))
            row = {"step": i + 1, **{k: float(v) for k, v in metrics.items()}}
            log.write(json.dumps(row) + "\n")
            bar.set_postfix(loss=f"{row['sft/loss']:.3g}", refresh=False)
            if i == 0:  # the compile's rate is never shown as an ETA
                restart_clock(bar, advance=1)
            else:
                bar.update(1)
            if i + 1 < sft.steps:
                signals.stop_if_requested(f"the {what} (SFT step {i + 1} of {sft.steps})", restart_hint)
    return state.model()


def run_sft(config: TrainConfig) -> Path:
    """`opd-jax sft`: the warm start alone, in a run directory of its own (checked and locked as
    every run's; never another command's or a finished one); returns the exported model's path."""
    from opd_jax.config import ConfigError, dump_config
    from opd_jax.models import save_model
    from opd_jax.train.build import build_model
    from opd_jax.train.preflight import check_run_inputs
    from opd_jax.train.run_dir import RunDirectory

    if config.sft.steps == 0:
        raise ConfigError("sft.steps is 0: nothing to train")
    check_run_inputs(mesh=config.mesh, models={"model": config.model}, data=config.data,
                     max_new_tokens=0)
    run_dir = Path(config.logging.run_dir)
    directory = RunDirectory(run_dir, "sft").open(resume=False)
    status = "failed"
    try:
        directory.record_config(dump_config(config))
        policy, tokenizer = build_model(config.model)
        with signals.stop_at_step_boundary():
            policy = warm_start(policy, tokenizer, config, run_dir / "sft_metrics.jsonl")
        out = save_model(policy, run_dir / "sft_policy", tokenizer)
        status = "finished"
    except Interrupted:
        status = "interrupted"
        raise
    finally:
        directory.close(status)
    return out
