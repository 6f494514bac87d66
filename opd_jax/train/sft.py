"""Supervised training as a task of the one run loop (`opd_jax.train.runner`): cross-entropy on
the response tokens of batches the task supplies, sharded like the RL steps. It serves the
supervised warm start (reference answers of the training domains, and an environment's expert
episodes), `opd-jax sft`, and the merge's warm-up on the teachers' samples. Each is a run of its
own directory (the warm start: RUN_DIR/warm_start/), so it has checkpoints, exact resume, the
stop at a step boundary, a progress bar and a summary, as every run."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from opd_jax.config import ConfigError, EpisodeSection, SFTSection, TrainConfig
from opd_jax.core import RolloutBatch, UpdateConfig, make_optimizer
from opd_jax.core.sft import sft_step
from opd_jax.core.state import PolicyState
from opd_jax.data import Example, take, train_prompts
from opd_jax.envs import TurnCodec, episode_factory
from opd_jax.envs.episodes import demonstration
from opd_jax.models import Decoder, Tokenizer, export_model
from opd_jax.run_files import WARM_START, checkpoint_steps, run_status
from opd_jax.train.batching import pad_rows
from opd_jax.train.build import add_configured_adapters, build_model, encode_prompt, stop_ids
from opd_jax.train.checkpoint import Checkpoints
from opd_jax.train.console import say
from opd_jax.train.episodes import episode_limits
from opd_jax.train.errors import RunError
from opd_jax.train.preflight import check_indexer_training, check_run_inputs
from opd_jax.train.runner import Task, run

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


class Demonstrations:
    """The warm start's batches: the training domains' reference answers (and environments'
    expert episodes), from a prompt stream of their own whose position a checkpoint keeps."""

    def __init__(self, config: TrainConfig, policy: Decoder, tokenizer: Tokenizer):
        self.config, self.policy, self.tokenizer = config, policy, tokenizer
        self.prompts = iter(train_prompts(config.data, seed_offset=_SFT_SEED_OFFSET))

    def __call__(self, step: int) -> RolloutBatch:
        c = self.config
        return demonstration_batch(take(self.prompts, c.sft.batch_size), self.tokenizer, self.policy,
                                   c.data.chat_template, c.rollout.episodes, c.rollout.max_new_tokens)

    def state(self) -> dict[str, Any]:
        return {"data": self.prompts.get_state()}

    def restore(self, saved: dict[str, Any]) -> None:
        self.prompts.set_state(saved["data"])


class SupervisedTask(Task):
    """`section.steps` cross-entropy updates (`sft_step`) of `policy` on the response tokens of
    batches(0), batches(1), ... (packed as section.pack says). `batches` may keep a position
    (`state()` / `restore()`, saved with each checkpoint); `export`: where `finish` writes the
    trained model (None: nowhere; the caller takes the final state) and, for a model with LoRA
    adapters, the adapters in PEFT's format beside it (`export_model`; `base_model` recorded)."""

    command = "sft"
    uses_engine = False
    nonfinite_inputs = "demonstration inputs"
    rows_name = "demonstrations"
    rows_key = "the supervised batch_size"

    def __init__(self, section: SFTSection, batches: Callable[[int], RolloutBatch], policy: Decoder,
                 tokenizer: Tokenizer, data: Any, *, description: str = "sft", export: Path | None = None,
                 check: Callable[[], None] | None = None, base_model: str | None = None):
        self.section, self.batches, self.export, self._check = section, batches, export, check
        self.base_model = base_model
        self.policy, self.tokenizer, self.data, self.description = policy, tokenizer, data, description
        self.update = UpdateConfig(pack=section.pack)
        self.step_fn = functools.partial(sft_step, router_balance_coef=section.router_balance_coef,
                                         index_dense_steps=0 if section.indexer is None else section.indexer.dense_steps)

    def rows_per_step(self, config: Any) -> int:
        return self.section.batch_size

    def check_inputs(self) -> None:
        if self._check is not None:
            self._check()
        check_indexer_training(self.section, self.policy.config, self.policy.config.lora is not None)

    def setup(self, run_dir: Path, mesh: jax.sharding.Mesh, resuming: bool) -> dict[str, float]:
        return {}

    def create_state(self) -> PolicyState:
        return PolicyState.create(self.policy, make_optimizer(self.section.optimizer, compute_dtype=self.trainer_dtype),
                                  trains_indexer=self.section.indexer is not None)

    def policy_params(self, state: PolicyState):
        return state.params

    def supplied_batch(self, step: int) -> tuple[RolloutBatch, list, dict[str, float]]:
        return self.batches(step), [], {}

    def resume_state(self) -> dict[str, Any]:
        return self.batches.state() if hasattr(self.batches, "state") else {}

    def restore(self, saved: dict[str, Any]) -> None:
        if hasattr(self.batches, "restore"):
            self.batches.restore(saved)

    def finish(self, state: PolicyState, run_dir: Path, phases: dict[str, float]) -> None:
        if self.export is not None:
            export_model(state.model(), self.export, self.tokenizer, base_model=self.base_model)


def phase_config(config: Any, run_dir: Path, steps: int) -> Any:
    """`config` as a supervised phase's run reads it: `steps` steps in `run_dir`, one checkpoint
    kept, no plots or exports of the RL run's."""
    logging = config.logging.model_copy(update={"run_dir": str(run_dir), "eval_at_start": False, "plot": False,
                                                "dump_rollouts": False})
    checkpoint = config.checkpoint.model_copy(update={"keep": 1, "export_hf": False})
    return config.model_copy(update={"steps": steps, "logging": logging, "checkpoint": checkpoint})


def supervised_phase(config: Any, task: SupervisedTask, run_dir: Path) -> Decoder:
    """The model after `task`'s steps, run as a phase of a larger run in `run_dir` (its own run
    directory): a new phase starts, an interrupted one resumes from its checkpoint, a finished
    one gives its final state back without training again."""
    phase = phase_config(config, run_dir, task.section.steps)
    if run_status(run_dir) == "finished":
        checkpoints = Checkpoints(run_dir / "checkpoints", 1, say=say)
        try:
            _, state, _ = checkpoints.restore_latest(task.create_state())
        finally:
            checkpoints.close()
        return state.model()
    _, state = run(phase, task, resume=bool(checkpoint_steps(run_dir)))
    return state.model()


def warm_start(policy: Decoder, tokenizer: Tokenizer, config: TrainConfig, run_dir: Path) -> Decoder:
    """`config.sft.steps` supervised updates of `policy` on the training domains' reference
    answers, as the phase RUN_DIR/warm_start/ of the run in `run_dir` (see `supervised_phase`)."""
    task = SupervisedTask(config.sft, Demonstrations(config, policy, tokenizer), policy, tokenizer, config.data,
                          description="warm start")
    return supervised_phase(config, task, run_dir / WARM_START)


def run_sft(config: TrainConfig, *, resume: bool = False) -> Path:
    """`opd-jax sft`: the warm start alone, in a run directory of its own (checked and locked as
    every run's; resumable); returns the exported model's path."""
    if config.sft.steps == 0:
        raise ConfigError("sft.steps is 0: nothing to train")
    run_dir = Path(config.logging.run_dir)
    policy, tokenizer = build_model(config.model)
    policy = add_configured_adapters(policy, config.model, config.seed)
    task = SupervisedTask(config.sft, Demonstrations(config, policy, tokenizer), policy, tokenizer, config.data,
                          export=run_dir / "sft_policy", base_model=config.model.path,
                          check=lambda: check_run_inputs(mesh=config.mesh, models={"model": config.model},
                                                         data=config.data, max_new_tokens=0))
    run(phase_config(config, run_dir, config.sft.steps), task, resume=resume)
    return run_dir / "sft_policy"
