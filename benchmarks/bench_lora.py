"""What LoRA saves: memory held for training (weights, optimizer state, the parameters that
train: `memory.json`'s figures, computed by the same `memory_report`) and the time of one
training step (θ_old scoring + the PPO step with the critic), full fine-tuning against LoRA
rank 8 and 32 on every projection (all-linear, α = 2r), and QLoRA rank 8 on an int8 and an
int4 (groups of 32) base, side by side in one run.

    python benchmarks/bench_lora.py [--models quickstart smollm2] [--repeats 3]

The models and batches are bench_critic_free.py's: quickstart (configs/quickstart.yaml's 0.6M
Llama, 16 prompts × 4 samples, 24 + 8 tokens) and SmolLM2-135M-Instruct (float32, 2 prompts × 4
samples, 64 + 64 tokens); PPO with the critic (GAE), AdamW, one mini-batch. Writes
benchmarks/results/lora.json (`--repeats 0`: the memory alone, no step timed, into
benchmarks/results/lora_memory.json).
"""

from __future__ import annotations

import jax
from bench_common import measure_models
from bench_critic_free import ROOT, SHAPES, batch_of, model_arguments, policy_of, step_seconds
from flax import nnx

from opd_jax.core import OptimizerConfig, PPOConfig, PPOState, make_optimizer
from opd_jax.models import ValueModel
from opd_jax.models.lora import LoraConfig
from opd_jax.models.quant import QuantScheme, quantize_decoder
from opd_jax.train.loop import memory_report

R8, R32 = LoraConfig(rank=8, alpha=16.0), LoraConfig(rank=32, alpha=64.0)
MODES = {"full": (None, None), "lora r8": (R8, None), "lora r32": (R32, None),
         "qlora r8 int8": (R8, QuantScheme("int8", "channel")), "qlora r8 int4": (R8, QuantScheme("int4", "group", 32))}


def measure(name: str, repeats: int) -> dict:
    batch = None
    config = PPOConfig(advantage="gae")
    tx = lambda: make_optimizer(OptimizerConfig(learning_rate=1e-6))  # noqa: E731
    out = {}
    for label, (lora, base) in MODES.items():
        policy = policy_of(name)
        if lora is not None:
            policy.add_lora(lora, nnx.Rngs(0))
        if base is not None:
            quantize_decoder(policy, base)
        batch = batch if batch is not None else batch_of(policy.config.vocab_size, *SHAPES[name])
        state = PPOState.create(policy, ValueModel.from_policy(policy, key=jax.random.key(1)), tx(), tx())
        seconds = step_seconds(state, batch, config, repeats) if repeats else None
        memory = memory_report(state)
        out[label] = {**{k: memory[k] for k in ("policy_gib", "critic_gib", "trained_gib", "optimizer_states_gib")},
                      "held_gib": memory["policy_gib"] + memory["critic_gib"] + memory["optimizer_states_gib"],
                      "step_s": seconds}
        del state, policy
    for label in MODES:
        out[label]["held_vs_full"] = out[label]["held_gib"] / out["full"]["held_gib"]
        out[label]["optimizer_vs_full"] = out[label]["optimizer_states_gib"] / out["full"]["optimizer_states_gib"]
        out[label]["step_vs_full"] = out[label]["step_s"] / out["full"]["step_s"] if repeats else None
    out["shape"] = dict(zip(("rows", "prompt", "response"), SHAPES[name]))
    return out


def main() -> None:
    args = model_arguments(__doc__)
    name = "lora.json" if args.repeats else "lora_memory.json"  # --repeats 0: memory only, no step timed
    results = measure_models(measure, args.models, args.repeats, ROOT / "benchmarks" / "results" / name)
    print("| model | training | trained GiB | optimizer GiB | held GiB (× full) | step s (× full) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, r in results["models"].items():
        for label in MODES:
            x = r[label]
            step = f"{x['step_s']:.3f} ({x['step_vs_full']:.2f}×)" if args.repeats else "not timed"
            print(f"| {name} | {label} | {x['trained_gib']:.4f} | {x['optimizer_states_gib']:.4f} | "
                  f"{x['held_gib']:.4f} ({x['held_vs_full']:.2f}×) | {step} |")


if __name__ == "__main__":
    main()
