"""`opd-jax plan`: whether a training config fits its accelerators, found before any cluster
runs it. Each program a run compiles (the PPO step, the θ_old scoring pass, the warm start's SFT
step) is compiled ahead of time for a mesh of N devices on abstract arrays (shapes only; no weight
is read or allocated), and XLA's memory analysis gives its per-device bytes: the arguments (the
train state and the batch), the outputs it does not write over its donated arguments, and its
temporaries. A run holds a program's arguments, outputs and temporaries at once, so the largest
such sum is its peak.

The programs are compiled for the simulated CPU devices of this process: an accelerator's compiler
fuses and schedules differently, so the bytes are XLA:CPU's (BENCHMARKS.md, "opd-jax plan",
compares a prediction with a run's measured peak)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from opd_jax.config import ConfigError, ModelSection, TrainConfig
from opd_jax.core import RolloutBatch
from opd_jax.data import take, train_prompts
from opd_jax.models import Decoder, ModelConfig, Tokenizer
from opd_jax.models.char_tokenizer import char_tokenizer
from opd_jax.models.io import read_model_config
from opd_jax.models.pretrained import resolve_model_path
from opd_jax.parallel import compile_abstract, make_mesh, scoring_jit, step_jit, tree_shardings
from opd_jax.sampling.choices import choice_shapes
from opd_jax.train.build import add_configured_adapters, encode_prompt, fresh_model_config
from opd_jax.train.loop import PPOTask
from opd_jax.train.sft import SupervisedTask

GIB = 1 << 30


def size(n: float) -> str:
    """Bytes as GiB, or MiB below a tenth of one."""
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):.1f} MiB"
_PROMPTS_MEASURED = 64  # training prompts tokenized for the default sequence length


class PlanError(ConfigError):
    """A plan that cannot be made: more devices than this process has, a sequence too short."""


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program's bytes per device (XLA's memory analysis)."""

    name: str
    arguments: int
    outputs: int
    aliased: int  # output bytes written over donated arguments
    temporaries: int

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries

    @classmethod
    def of(cls, name: str, compiled: jax.stages.Compiled) -> Program:
        m = compiled.memory_analysis()
        return cls(name, m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
                   m.temp_size_in_bytes)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A config's programs on `devices` devices of a mesh `mesh` ({axis: size}), a step's batch of
    `rows` sequences of `tokens` tokens; `weights` and `optimizer` per device (the PPO state's)."""

    devices: int
    mesh: dict[str, int]
    rows: int
    tokens: int
    weights: int
    optimizer: int
    programs: tuple[Program, ...]

    @property
    def peak(self) -> int:
        return max(p.peak for p in self.programs)

    def fits(self, hbm_gib: float) -> bool:
        return self.peak <= hbm_gib * GIB

    def table(self, hbm_gib: float | None = None) -> str:
        mesh = ", ".join(f"{k}={v}" for k, v in self.mesh.items())
        lines = [f"{self.devices} devices (mesh {mesh}); a step's batch: {self.rows} rows × {self.tokens} tokens; "
                 f"bytes per device, compiled for XLA:CPU",
                 f"weights {size(self.weights)}, optimizer state {size(self.optimizer)}", "",
                 "| program | arguments | outputs (not donated) | temporaries | peak |", "| --- | ---: | ---: | ---: | ---: |"]
        lines += [f"| {p.name} | {size(p.arguments)} | {size(p.outputs - p.aliased)} | {size(p.temporaries)} | "
                  f"{size(p.peak)} |" for p in self.programs]
        verdict = "" if hbm_gib is None else (f" of {hbm_gib:g} GiB: fits" if self.fits(hbm_gib)
                                              else f" of {hbm_gib:g} GiB: does not fit")
        aliased = max(p.aliased for p in self.programs)
        return "\n".join([*lines, "", f"peak {size(self.peak)} per device{verdict}",
                           f"(outputs written over donated arguments: up to {size(aliased)}; a runtime that "
                           f"does not reuse donated buffers, as XLA:CPU's here, needs them on top)"])


def refusal(plan: Plan, hbm_gib: float, what: str) -> str:
    """The one line that says `plan` does not fit `hbm_gib` of accelerator memory, and what to try."""
    return (f"{what}: the peak is {size(plan.peak)} per device, over {hbm_gib:g} GiB "
            f"({plan.rows} rows × {plan.tokens} tokens on {plan.devices} devices); try model.remat: full, "
            f"a smaller model.attention_block or model.logits_chunk, algorithm.ppo.update.microbatches, "
            f"mesh.fsdp, mesh.sequence (long rows) or more devices "
            f"(opd-jax plan CONFIG --devices N --hbm GiB shows each program)")


def plan_devices(count: int) -> list[jax.Device]:
    """`count` devices of this process to compile for: simulated CPU devices, as many as asked when
    JAX has not started yet (XLA reads its flags once, when the first device is listed)."""
    if count < 1:
        raise PlanError(f"--devices {count}: give at least 1")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    devices = jax.devices("cpu")
    if len(devices) < count:
        raise PlanError(f"--devices {count}: this process has {len(devices)} CPU devices (XLA_FLAGS was set before "
                        f"the plan); run `opd-jax plan` in a fresh process, or set "
                        f"--xla_force_host_platform_device_count={count}")
    return devices[:count]


def model_architecture(section: ModelSection) -> tuple[ModelConfig, Tokenizer | None]:
    """The architecture and tokenizer a model section describes, no weight read."""
    if section.fresh is not None:
        return fresh_model_config(section.fresh), char_tokenizer()
    return read_model_config(resolve_model_path(section.path))


def default_tokens(config: TrainConfig, tokenizer: Tokenizer | None) -> int:
    """A step's sequence length as a run's first steps make it: the longest of the first training
    prompts, tokenized, plus rollout.max_new_tokens; multi-turn episodes: their token budget."""
    if any(spec.environment is not None for spec in config.data.train):
        return config.rollout.episodes.max_tokens
    if tokenizer is None:
        raise PlanError("the model has no tokenizer to measure the prompts with; give --tokens")
    prompts = take(iter(train_prompts(config.data)), _PROMPTS_MEASURED)
    return max(len(encode_prompt(p, tokenizer, config.data.chat_template)) for p in prompts) + \
        config.rollout.max_new_tokens


def _abstract_batch(rows: int, tokens: int, model: ModelConfig, choices: Sequence[str]) -> RolloutBatch:
    """A batch as the rollout session builds it (shapes only); `choices`: the engine's recorded
    choices the step replays ("experts", "indices")."""
    f32, i32 = (lambda *shape: jax.ShapeDtypeStruct(shape, t) for t in (jnp.float32, jnp.int32))
    shapes = choice_shapes(model)
    recorded = {"routing" if name == "experts" else name: i32(rows, tokens, *shapes[name])
                for name in choices if name in shapes}
    return RolloutBatch(tokens=i32(rows, tokens), attention_mask=i32(rows, tokens), response_mask=f32(rows, tokens),
                        logp_infer=f32(rows, tokens), rewards=f32(rows), **recorded)


def _per_device(tree: Any, mesh: jax.sharding.Mesh) -> int:
    """Bytes of `tree`'s arrays on one device, sharded by their logical axes."""
    leaves = jax.tree.leaves(tree)
    shardings = jax.tree.leaves(tree_shardings(tree, mesh))
    return sum(math.prod(s.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize for x, s in zip(leaves, shardings))


def plan_train(config: TrainConfig, devices: Sequence[jax.Device], tokens: int | None = None) -> Plan:
    """The plan of `opd-jax train CONFIG` on `devices`: its PPO step and scoring pass, and the
    warm start's SFT step when it has one, at `tokens` per sequence (None: `default_tokens`)."""
    architecture, tokenizer = model_architecture(config.model)
    tokens = default_tokens(config, tokenizer) if tokens is None else tokens
    if tokens < 2:
        raise PlanError(f"--tokens {tokens}: a sequence needs at least 2 tokens")
    mesh = make_mesh(config.mesh, devices)
    task = PPOTask(config)
    section = config.model

    def policy() -> Decoder:
        model = Decoder(architecture, param_dtype=jnp.dtype(section.dtype), compute_dtype=section.compute_dtype,
                        rngs=nnx.Rngs(0)).set_execution(section.execution())
        return add_configured_adapters(model, section, config.seed)

    def ppo_state():
        task.policy = policy()
        return task.create_state()

    state = jax.eval_shape(ppo_state)
    choices = [name for name, on in (("experts", task.replays_routing), ("indices", task.replays_indices)) if on]
    batch = _abstract_batch(task.rows_per_step(config), tokens, architecture, choices)
    scored = jax.eval_shape(task.scoring_fn, state, batch)
    programs = [Program.of("ppo step", compile_abstract(step_jit(task.step_fn, state, scored, mesh), mesh, state, scored)),
                Program.of("scoring (θ_old)", compile_abstract(scoring_jit(task.scoring_fn, state, batch, mesh), mesh,
                                                               state, batch))]
    if config.sft.steps:  # the warm start's own task: its step and state as it builds them
        warm = SupervisedTask(config.sft, batches=None, policy=None, tokenizer=None, data=config.data)

        def warm_state():
            warm.policy = policy()
            return warm.create_state()

        sft_state = jax.eval_shape(warm_state)
        sft_batch = _abstract_batch(warm.rows_per_step(config), tokens, architecture, ())
        programs.append(Program.of("sft step (warm start)", compile_abstract(
            step_jit(warm.step_fn, sft_state, sft_batch, mesh), mesh, sft_state, sft_batch)))
    weights = _per_device((state.policy, state.critic, state.reference), mesh)
    optimizer = _per_device((state.policy_opt, state.critic_opt), mesh)
    return Plan(devices=len(devices), mesh=dict(zip(mesh.axis_names, mesh.devices.shape)), rows=batch.tokens.shape[0],
                tokens=tokens, weights=weights, optimizer=optimizer, programs=tuple(programs))
