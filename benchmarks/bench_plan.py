"""Does `opd-jax plan` predict a run's memory? Its PPO-step peak (arguments + outputs not donated
+ temporaries, from the compiled memory analysis on abstract arrays) against the memory a real
step takes here: in a process with one CPU device, the step is compiled for the real state
and batch and run once; the measured peak is the process's peak resident
the step's arguments (the bytes of the state's and batch's arrays) plus how far the process's
peak resident memory rose during the step (VmHWM, reset just before it through
/proc/self/clear_refs, minus the resident memory then). On the CPU, device memory is this
process's memory.

usage: python benchmarks/bench_plan.py [--config configs/smollm2_word_problems.yaml] [--rows 4] [--tokens 512]
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from opd_jax.config import TrainConfig, load_config  # noqa: E402
from opd_jax.core import RolloutBatch  # noqa: E402
from opd_jax.parallel import compile_abstract, make_mesh, shard, step_jit, tree_shardings  # noqa: E402
from opd_jax.train.build import add_configured_adapters, build_model  # noqa: E402
from opd_jax.train.loop import PPOTask  # noqa: E402
from opd_jax.train.plan import GIB, plan_train  # noqa: E402

ROOT = Path(__file__).parents[1]


def status(field: str) -> int:
    """A /proc/self/status memory field in bytes."""
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2_word_problems.yaml")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    config = load_config(args.config, ["sft.steps=0", f"data.prompts_per_step={args.rows}",
                                       "rollout.samples_per_prompt=1", *args.overrides], schema=TrainConfig)
    devices = jax.devices()[:1]
    plan = plan_train(config, devices, args.tokens)
    predicted = plan.programs[0]

    task = PPOTask(config)
    task.policy = add_configured_adapters(build_model(config.model)[0], config.model, config.seed)
    mesh = make_mesh(config.mesh, devices)
    state = task.create_state()
    state = shard(state, tree_shardings(state, mesh))
    vocab = task.vocab_size
    del task.policy  # the built model's own copy of the weights: only the state's stay
    rng = np.random.default_rng(0)
    R, T = args.rows, args.tokens
    batch = RolloutBatch(tokens=rng.integers(0, vocab, (R, T)).astype(np.int32),
                         attention_mask=np.ones((R, T), np.int32),
                         response_mask=np.concatenate([np.zeros((R, T // 2)), np.ones((R, T - T // 2))], 1
                                                      ).astype(np.float32),
                         logp_infer=np.full((R, T), -1.0, np.float32), rewards=np.ones(R, np.float32))
    scored = jax.block_until_ready(jax.jit(task.scoring_fn)(state, batch))
    step = compile_abstract(step_jit(task.step_fn, state, scored, mesh), mesh, state, scored)
    arguments = sum(x.nbytes for x in jax.tree.leaves((state, scored)))
    gc.collect()
    before = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    began = time.perf_counter()
    old = jax.tree.leaves(state)
    state, metrics = step(state, scored)
    jax.block_until_ready((state, metrics))
    donated = sum(x.is_deleted() for x in old) / len(old)
    seconds = time.perf_counter() - began
    grew = status("VmHWM") - before
    measured = arguments + grew
    print(f"{args.config.name} ({' '.join(args.overrides) or 'as configured'}), {R} rows x {T} tokens, one CPU device; "
          f"step {seconds:.1f} s")
    apart = predicted.arguments + predicted.outputs + predicted.temporaries
    print(f"plan: arguments {predicted.arguments / GIB:.3f} + temporaries {predicted.temporaries / GIB:.3f} "
          f"= peak {predicted.peak / GIB:.3f} GiB (outputs {predicted.outputs / GIB:.3f} GiB, written over the donated "
          f"state); counting the outputs apart: {apart / GIB:.3f} GiB")
    print(f"measured: arguments (the state's and batch's arrays) {arguments / GIB:.3f} GiB + the step's growth of "
          f"peak resident memory {grew / GIB:.3f} GiB = {measured / GIB:.3f} GiB ({donated:.0%} of the state's arrays "
          f"donated); plan / measured = {predicted.peak / measured:.3f}, with the outputs apart {apart / measured:.3f}")


if __name__ == "__main__":
    main()
