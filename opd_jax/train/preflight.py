"""Every input of a run checked before any work: before the model is built and before the run
directory is created or touched. Each problem is one line naming the key, the file:line or the
sample: the mesh against the devices, every model path (and that it holds a model), the reward
function's import, every prompt file (existence, UTF-8, JSON, fields) and every prompt's length
against the model's context."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp

from opd_jax.config import ConfigError, DataSection, ModelSection
from opd_jax.config.schema import RolloutSection, SFTSection
from opd_jax.core import PPOConfig
from opd_jax.core.registry import AdvantageInputs
from opd_jax.data import eval_prompts, read_jsonl, training_stream
from opd_jax.data.domains import Example
from opd_jax.data.sources import DataError, problem_key
from opd_jax.models import Tokenizer, resolve_model_path
from opd_jax.models.char_tokenizer import char_tokenizer
from opd_jax.models.config import ModelConfig, ModelFormatError
from opd_jax.models.quant import check_quantizable
from opd_jax.parallel import MeshConfig, make_mesh
from opd_jax.rewards import RewardError, compute_rewards, load_reward_fn
from opd_jax.train.build import encode_prompt, fresh_model_config
from opd_jax.train.console import say
from opd_jax.train.engines import sglang_server_flags


def check_mesh(key: str, mesh: MeshConfig) -> None:
    try:
        make_mesh(mesh)
    except ValueError as e:
        raise type(e)(f"{key}: {e}") from None


def check_model(key: str, section: ModelSection) -> tuple[Tokenizer | None, ModelConfig | None]:
    """The model section's tokenizer and architecture, read without loading its weights (None
    for a GGUF file, whose metadata is read with its weights when the model is built)."""
    if section.fresh is not None:
        # an inconsistent architecture (experts, heads, ...) named now
        return char_tokenizer(), fresh_model_config(section.fresh)
    try:
        path = resolve_model_path(section.path)
    except ModelFormatError as e:
        raise ModelFormatError(f"{key}.path: {e}") from None
    if not path.exists():
        raise ModelFormatError(f"{key}.path: {path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelFormatError(f"{key}.path: {path} is neither a Hugging Face model directory nor a .gguf file")
        return None, None
    if not (path / "config.json").is_file():
        raise ModelFormatError(f"{key}.path: {path} holds no config.json (not a Hugging Face model directory)")
    return Tokenizer.from_dir(path), ModelConfig.from_json(path / "config.json")


def check_reward_fn(key: str, path: str | None) -> None:
    """The reward function imports, and takes f(prompt, response, answer, domain)."""
    if path is None:
        return
    try:
        fn = load_reward_fn(path)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None
    try:
        inspect.signature(fn).bind("prompt", "response", "answer", "domain")
    except TypeError as e:
        raise ConfigError(f"{key}: {path} cannot be called as f(prompt, response, answer, domain): {e}") from None
    except ValueError:  # a builtin without a signature: the probe on the answers below decides
        pass


def check_rewards(data: DataSection) -> None:
    """The reward function on each domain's first held-out problem with the reference answer as the
    response, before anything is built: where it raises, returns a non-number or a NaN/inf, the run
    would stop at its first evaluation or step (data.on_bad_reward: skip keeps such samples out
    instead, so then nothing is checked)."""
    if data.reward_fn is None or data.on_bad_reward == "skip":
        return
    reward_fn = load_reward_fn(data.reward_fn)
    for _, examples in sorted(eval_prompts(data).items()):
        example = examples[0]
        if example.episode is not None:
            continue  # an environment gives its own rewards
        try:
            compute_rewards([example.answer], [example], reward_fn)
        except RewardError as e:
            raise ConfigError(f"data.reward_fn, checked on the reference answers before the run: {e} "
                              f"(data.on_bad_reward: skip drops such samples)") from None


def check_estimator(key: str, ppo: PPOConfig, group_size: int) -> None:
    """The advantage estimator traced on a tiny batch of `group_size`-sample groups (no compute):
    a plugin that raises or returns anything but [B, T] advantages is named now, not after the
    warm start."""
    B, T = 2 * group_size, 6
    mask = jnp.ones((B, T), jnp.float32)
    inputs = AdvantageInputs(rewards=jnp.zeros(B), token_rewards=mask * 0, mask=mask,
                             values=mask * 0 if ppo.uses_critic else None, final_values=None, group_size=group_size)
    try:
        out = jax.eval_shape(lambda x: ppo.estimator.fn(x, ppo, **ppo.advantage_params), inputs)
    except Exception as e:  # the user's code, traced: whatever it raises names it
        raise ConfigError(f"{key}.advantage: {ppo.advantage} raised {type(e).__name__}: {str(e).splitlines()[0]} "
                          f"on a batch of {B} samples × {T} tokens") from None
    shape = getattr(out, "shape", None)
    if shape != (B, T):
        what = f"shape {tuple(shape)}" if shape is not None else type(out).__name__
        raise ConfigError(f"{key}.advantage: {ppo.advantage} returned {what} "
                          f"on a batch of {B} samples × {T} tokens; an advantage estimator returns one advantage "
                          f"per token, [B, T] = ({B}, {T})")


# training prompts of a built-in domain measured against the context: its held-out set is measured whole
_BUILTIN_DRAWS = 256


def check_data(data: DataSection, tokenizer: Tokenizer | None, context: int | None, max_new_tokens: int) -> None:
    """Every JSONL prompt file of the data section parses, and every prompt (train and held-out)
    leaves room for max_new_tokens in the model's context: each JSONL prompt, a built-in domain's
    held-out prompts and a draw of its training stream."""
    if context is not None and max_new_tokens >= context:
        raise ConfigError(f"rollout.max_new_tokens is {max_new_tokens}, which leaves no room for a prompt in the "
                          f"model's context of {context} tokens")
    if tokenizer is not None and context is not None:
        _check_builtin_lengths(data, tokenizer, context, max_new_tokens)
    for i, spec in enumerate(data.train):
        if spec.jsonl is not None and spec.eval_jsonl is not None:
            warn_shared_prompts(f"data.train[{i}]", read_jsonl(spec.jsonl), read_jsonl(spec.eval_jsonl))
        for field in ("jsonl", "eval_jsonl"):
            file = getattr(spec, field)
            if file is None:
                continue
            examples = read_jsonl(file)
            if tokenizer is None or context is None:
                continue
            for example in examples:
                try:
                    length = len(encode_prompt(example, tokenizer, data.chat_template))
                except ValueError as e:  # no chat template, ...
                    raise DataError(f"{Path(file)}:{_line(example.uid)}: {e}") from None
                if length + max_new_tokens > context:
                    raise DataError(f"{Path(file)}:{_line(example.uid)}: the prompt is {length} tokens; with "
                                    f"rollout.max_new_tokens {max_new_tokens} that is more than the model's context of "
                                    f"{context} (data.train[{i}].{field})")


def warn_shared_prompts(key: str, train: list[Example], held_out: list[Example]) -> None:
    """A warning (not an error: the user chose these files) when held-out prompts are also
    training prompts, so the held-out accuracy is not held out."""
    trained = {problem_key(e) for e in train}
    shared = [e for e in held_out if problem_key(e) in trained]
    if shared:
        say(f"warning: {key}: {len(shared)} of the {len(held_out)} held-out prompts ({shared[0].uid} first) are "
            f"also training prompts, so their accuracy is not held out")


def _check_builtin_lengths(data: DataSection, tokenizer: Tokenizer, context: int, max_new_tokens: int) -> None:
    held_out = eval_prompts(data)
    for i, spec in enumerate(data.train):
        if spec.builtin is None:
            continue
        drawn = training_stream(data, i)
        for example in [*held_out.get(spec.builtin, []), *(drawn[j] for j in range(_BUILTIN_DRAWS))]:
            length = len(encode_prompt(example, tokenizer, data.chat_template))
            if length + max_new_tokens > context:
                raise DataError(f"data.train[{i}] ({spec.builtin}): prompt {example.uid} is {length} tokens; with "
                                f"rollout.max_new_tokens {max_new_tokens} that is more than the model's context of "
                                f"{context}")


def _line(uid: str) -> str:
    return uid.rpartition(":")[2]


def check_engine(key: str, rollout: RolloutSection, config: ModelConfig | None) -> None:
    """The engine's numerics can be served: the weight quantization fits the policy's weights
    (its block size divides them), and SGLang servers the bridge launches can run them."""
    scheme = rollout.quantization.scheme()
    if scheme is not None and config is not None:
        try:
            check_quantizable(config, scheme)
        except ModelFormatError as e:
            raise ConfigError(f"{key}.quantization.block_size: {e}") from None
    if rollout.engine == "sglang":
        if rollout.sglang.launch is None and (scheme is not None or rollout.kv_cache_dtype is not None):
            raise ConfigError(f"{key}.quantization / {key}.kv_cache_dtype: servers at {key}.sglang.urls run as they "
                              f"were started; set these for servers the bridge launches ({key}.sglang.launch)")
        sglang_server_flags(rollout)
        command = list(rollout.sglang.launch.command) if rollout.sglang.launch is not None else []
        served = command[command.index("--dtype") + 1] if "--dtype" in command[:-1] else None
        if served is not None and served != rollout.dtype:
            raise ConfigError(f"{key}.dtype is {rollout.dtype} but {key}.sglang.launch.command serves --dtype {served}: "
                              f"make them agree (the census and the run's records take {key}.dtype for the engine's)")


def check_index_replay(key: str, enabled: bool, rollout: RolloutSection, config: ModelConfig | None = None) -> None:
    """Index replay (`key`: the config key that turns it on) needs an engine that records the
    indexers' choices (the embedded one) and, once the policy is built (`config`), a DSA model."""
    if not enabled:
        return
    if rollout.engine == "sglang":
        raise ConfigError(f"{key} needs the embedded engine (rollout.engine: embedded): SGLang servers do not return "
                          f"the keys DSA's indexers chose")
    if config is not None and config.dsa is None:
        raise ConfigError(f"{key}: the policy ({config.family}) has no DSA indexer to replay; it is for glm_moe_dsa "
                          f"models (GLM-5)")


def check_indexer_training(section: SFTSection, config: ModelConfig | None, lora: bool) -> None:
    """sft.indexer trains DSA's indexers: the policy (`config`, its architecture; None: not known
    yet) must have them, and no LoRA adapters (`lora`: they train alone, the indexers being part
    of the frozen base)."""
    if section.indexer is None or not section.steps:
        return
    if config is not None and config.dsa is None:
        raise ConfigError(f"sft.indexer: the policy ({config.family}) has no DSA indexer to train; it is for "
                          f"glm_moe_dsa models (GLM-5)")
    if lora:
        raise ConfigError("sft.indexer: a policy with LoRA adapters trains the adapters alone (the indexers are part "
                          "of its frozen base); train the indexers without model.lora")


def check_run_inputs(*, mesh: MeshConfig, models: Mapping[str, ModelSection], data: DataSection,
                     max_new_tokens: int, rollout: RolloutSection | None = None) -> ModelConfig | None:
    """All of a run's inputs; `models` maps each model's config key to its section, the first
    being the one that reads the prompts of `data` (the config's `data` section) and that the
    `rollout` engine serves. Returns that first model's architecture (None for a GGUF file, read
    only when the model is built)."""
    check_mesh("mesh", mesh)
    described = [check_model(key, section) for key, section in models.items()]
    for (key, section), (_, config) in zip(models.items(), described):
        if section.remat == "offload" and jax.default_backend() == "cpu":
            raise ConfigError(f"{key}.remat: offload moves saved activations to an accelerator's pinned host memory, "
                              f"and this run is on the CPU; use full or dots")
        scheme = section.lora.base_quantization.scheme() if section.lora is not None else None
        if scheme is not None and config is not None:
            try:
                check_quantizable(config, scheme)
            except ModelFormatError as e:
                raise ConfigError(f"{key}.lora.base_quantization.block_size: {e}") from None
    check_reward_fn("data.reward_fn", data.reward_fn)
    tokenizer, config = described[0] if described else (None, None)
    check_data(data, tokenizer, None if config is None else config.max_position_embeddings, max_new_tokens)
    check_rewards(data)
    if rollout is not None:
        check_engine("rollout", rollout, config)
        if data.has_environments and config is not None and rollout.episodes.max_tokens > config.max_position_embeddings:
            raise ConfigError(f"rollout.episodes.max_tokens is {rollout.episodes.max_tokens}, more than the model's "
                              f"context of {config.max_position_embeddings} tokens")
    return config

