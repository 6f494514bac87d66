"""Memory of one OPD step (the merge's student update) at growing sequence length, compiled ahead
of time on abstract arrays (nothing allocated): a Qwen3-0.6B-shaped student
(benchmarks/qwen3_0.6b/config.json, no weights), Adam, one sequence, float32, one device, state
donated, for each loss: sampled (GLM-5's, the sampled tokens' reverse KL), top_k (the teacher's
top 32) and full (the whole vocabulary; its batch carries the teacher's [T, V] distribution).
Side by side: the LM head in chunks of 2,048 positions (the default, `model.logits_chunk`) and in
one piece (the step before it was chunked). Bytes from XLA:CPU's memory analysis.

usage: python benchmarks/bench_opd_memory.py [--lengths 4096 16384] [--losses sampled top_k full]
"""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from opd_jax.core import (  # noqa: E402
    DistillBatch,
    OPDConfig,
    OptimizerConfig,
    PolicyState,
    RolloutBatch,
    make_optimizer,
    opd_step,  # noqa: E402
)
from opd_jax.models import Decoder  # noqa: E402
from opd_jax.models.execution import Execution  # noqa: E402
from opd_jax.models.io import read_model_config  # noqa: E402
from opd_jax.train.plan import GIB  # noqa: E402

ARCHITECTURE = Path(__file__).with_name("qwen3_0.6b")
TOP_K = 32


def batch(tokens: int, vocab: int, loss: str) -> DistillBatch:
    f32, i32 = (lambda *shape: jax.ShapeDtypeStruct(shape, t) for t in (jnp.float32, jnp.int32))
    rollout = RolloutBatch(tokens=i32(1, tokens), attention_mask=i32(1, tokens), response_mask=f32(1, tokens),
                           logp_infer=f32(1, tokens), rewards=f32(1), logp_old=f32(1, tokens))
    teacher = {"sampled": {}, "top_k": dict(teacher_logprobs=f32(1, tokens, TOP_K), teacher_ids=i32(1, tokens, TOP_K)),
               "full": dict(teacher_logprobs=f32(1, tokens, vocab))}[loss]
    return DistillBatch(rollout=rollout, teacher_index=i32(1), logp_teacher=f32(1, tokens), **teacher)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--losses", nargs="+", default=["sampled", "top_k", "full"], choices=["sampled", "top_k", "full"])
    args = parser.parse_args()
    architecture, _ = read_model_config(ARCHITECTURE)
    print("OPD step (student, Adam, state donated), batch 1, float32, XLA:CPU, one device; GiB")
    print("| loss | tokens | logits | arguments | temporaries | peak |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for loss in args.losses:
        for tokens in args.lengths:
            for name, chunk in (("whole", 1 << 30), ("chunks of 2,048", 2048)):
                def state(chunk: int = chunk) -> PolicyState:
                    model = Decoder(architecture, rngs=nnx.Rngs(0)).set_execution(Execution(logits_chunk=chunk))
                    return PolicyState.create(model, make_optimizer(OptimizerConfig()))
                abstract = jax.eval_shape(state)
                distill = batch(tokens, architecture.vocab_size, loss)
                step = functools.partial(opd_step, config=OPDConfig(loss=loss, top_k=TOP_K))
                memory = jax.jit(step, donate_argnums=(0,)).lower(abstract, distill).compile().memory_analysis()
                arguments = memory.argument_size_in_bytes
                temporaries = memory.temp_size_in_bytes
                print(f"| {loss} | {tokens} | {name} | {arguments / GIB:.2f} | {temporaries / GIB:.2f} | "
                      f"{(arguments + temporaries) / GIB:.2f} |", flush=True)


if __name__ == "__main__":
    main()
