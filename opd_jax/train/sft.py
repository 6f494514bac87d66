"""The supervised warm start: reference answers of the training domains, cross-entropy on the
answer tokens (and the stop token), sharded like the PPO step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from opd_jax.config import TrainConfig
from opd_jax.core import RolloutBatch, make_optimizer
from opd_jax.core.sft import sft_step
from opd_jax.core.state import PolicyState
from opd_jax.data import Example, take, train_prompts
from opd_jax.models import Decoder, Tokenizer
from opd_jax.parallel import batch_shardings, make_mesh, shard, sharded_step, tree_shardings
from opd_jax.train.batching import pack
from opd_jax.train.build import encode_prompt, stop_ids

# the warm start reads its own stream, so RL later sees the same prompts with or without it
_SFT_SEED_OFFSET = 7919


def demonstration_batch(examples: list[Example], tokenizer: Tokenizer, policy: Decoder, chat: bool) -> RolloutBatch:
    """Prompt + reference answer + stop token per example; the loss covers answer and stop."""
    eos = stop_ids(tokenizer, policy)[0]
    tokens, attention, response = pack(
        [encode_prompt(e, tokenizer, chat) for e in examples],
        [[*tokenizer.encode(e.answer, add_special_tokens=False), eos] for e in examples],
        pad_id=tokenizer.pad_token_id or 0)
    return RolloutBatch(tokens=tokens, attention_mask=attention, response_mask=response,
                        logp_infer=np.zeros_like(response), rewards=np.zeros(len(examples), np.float32))


def warm_start(policy: Decoder, tokenizer: Tokenizer, config: TrainConfig, log_path: Path) -> Decoder:
    """`config.sft.steps` supervised updates of `policy`; the loss per step goes to log_path."""
    data = config.data.model_copy(update={"seed": config.data.seed + _SFT_SEED_OFFSET})
    prompts = iter(train_prompts(data))
    state = PolicyState.create(policy, make_optimizer(config.sft.optimizer))
    mesh = make_mesh(config.mesh)
    state = shard(state, tree_shardings(state, mesh))
    step = None
    with log_path.open("w") as log:
        for i in range(config.sft.steps):
            batch = demonstration_batch(take(prompts, config.sft.batch_size), tokenizer, policy,
                                        config.data.chat_template)
            step = step or sharded_step(sft_step, state, batch, mesh)
            state, metrics = step(state, shard(batch, batch_shardings(batch, mesh)))
            log.write(json.dumps({"step": i + 1, **{k: float(v) for k, v in metrics.items()}}) + "\n")
    return state.model()
