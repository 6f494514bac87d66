"""Low-precision rollout engines against the f32 trainer, side by side in one run: per engine
setting (f32, bf16, and bf16 activations with FP8 / INT8 / INT4 weights or an FP8 KV cache), the
train/inference mismatch of what the engine samples (mean |Δlogp|, k3 KL(engine ‖ trainer), the
fraction of tokens outside IcePop's [0.5, 2], the ratio's 1% and 99% quantiles), the engine's
decode speed and its memory (weights + KV cache of the batch).

Models: the quickstart's policy after its warm start (`opd-jax sft configs/quickstart.yaml`, run
here once) on held-out addition and multiplication prompts, and SmolLM2-135M-Instruct (GGUF,
dequantized to f32) on word problems with its chat template. Each setting samples the same
prompts with each seed (T = 1); every mismatch figure is the mean over seeds with a 95%
t-interval. Decode speed: the batch's generated tokens over wall time, best of the seeds, as a
ratio to the f32 engine's.

usage: python benchmarks/bench_engines.py [--models quickstart smollm2] [--prompts 32] [--new 24]
       [--seeds 0 1 2] [--out runs/bench_engines]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import machine, t_interval
from flax import nnx

from opd_jax.config import load_config
from opd_jax.core import policy_logprobs
from opd_jax.core.mismatch import MismatchCorrection, mismatch_metrics
from opd_jax.data import eval_prompts
from opd_jax.models import load_model, smollm2_gguf
from opd_jax.models.quant import QuantizedWeight, QuantScheme
from opd_jax.sampling import Sampler
from opd_jax.train.batching import rollouts_to_batch
from opd_jax.train.build import EngineNumerics, encode_prompt, engine_model, stop_ids
from rollout_bridge.records import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {
    "f32": EngineNumerics("float32"),
    "bf16": EngineNumerics("bfloat16"),
    "bf16 + fp8 weights (channel)": EngineNumerics("bfloat16", QuantScheme("fp8", "channel")),
    "bf16 + fp8 weights (64² blocks)": EngineNumerics("bfloat16", QuantScheme("fp8", "block", 64)),
    "bf16 + int8 weights (channel)": EngineNumerics("bfloat16", QuantScheme("int8", "channel")),
    "bf16 + int4 weights (groups of 64)": EngineNumerics("bfloat16", QuantScheme("int4", "group", 64)),
    "bf16 + fp8 KV cache": EngineNumerics("bfloat16", kv_cache_dtype="float8_e4m3fn"),
}
FIGURES = {"abs_dlogp": "mismatch_abs_logp_diff", "kl_k3": "mismatch_kl_k3",
           "outside": "mismatch_outside_band_frac", "q01": "mismatch_ratio_q01", "q99": "mismatch_ratio_q99"}


def quickstart(out: Path, prompts: int):
    sft = out / "quickstart_sft"
    if not (sft / "sft_policy").exists():
        subprocess.run([sys.executable, "-m", "opd_jax.cli", "sft", str(ROOT / "configs" / "quickstart.yaml"),
                        f"logging.run_dir={sft}", "logging.progress_bar=false"], check=True)
    model, tokenizer = load_model(sft / "sft_policy")
    config = load_config(ROOT / "configs" / "quickstart.yaml", [f"data.eval_prompts_per_domain={prompts // 2}"])
    examples = [e for v in eval_prompts(config.data).values() for e in v][:prompts]
    return model, [encode_prompt(e, tokenizer, False) for e in examples], stop_ids(tokenizer, model)


def smollm2(prompts: int):
    model, tokenizer = load_model(smollm2_gguf())
    config = load_config(ROOT / "configs" / "smollm2_word_problems.yaml", [f"data.eval_prompts_per_domain={prompts}"])
    examples = [e for v in eval_prompts(config.data).values() for e in v][:prompts]
    return model, [encode_prompt(e, tokenizer, True) for e in examples], stop_ids(tokenizer, model)


def weight_bytes(model) -> int:
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return sum(x.nbytes if isinstance(x, QuantizedWeight) else x.size * x.dtype.itemsize for x in leaves)


def kv_bytes(config, batch: int, slots: int, numerics: EngineNumerics) -> int:
    dtype = jnp.dtype(numerics.kv_cache_dtype or numerics.dtype)
    values = 2 * config.num_layers * batch * slots * config.num_kv_heads * config.head_dim * dtype.itemsize
    scales = 2 * config.num_layers * batch * slots * config.num_kv_heads * 4 if dtype == jnp.float8_e4m3fn else 0
    return values + scales


def measure(model, prompts, stops, numerics: EngineNumerics, seeds: list[int], new: int) -> dict:
    engine = engine_model(model.config, nnx.state(model, nnx.Param), numerics)
    slots = max(len(p) for p in prompts) + new + 1
    sampler = Sampler(engine, max_cache_len=slots, kv_cache_dtype=numerics.kv_cache_dtype)
    params = SamplingParams(max_new_tokens=new, temperature=1.0, stop_token_ids=stops)
    sampler.generate(prompts[:2], params, jax.random.key(99))  # compile
    graphdef, state = nnx.split(model)
    runs, speeds = [], []
    for seed in seeds:
        began = time.perf_counter()
        rollouts = sampler.generate(prompts, params, jax.random.key(seed))
        wall = time.perf_counter() - began
        speeds.append(sum(len(r.output_ids) for r in rollouts) / wall)
        batch = rollouts_to_batch(rollouts, np.zeros(len(rollouts)), pad_id=0)
        trainer = policy_logprobs(graphdef, state, batch)
        metrics = mismatch_metrics(trainer, batch.logp_infer, batch.response_mask, MismatchCorrection("icepop", hi=2.0))
        runs.append({name: float(metrics[key]) for name, key in FIGURES.items()})
    row = {name: t_interval([r[name] for r in runs]) for name in FIGURES}
    row.update(tokens_per_s=max(speeds), weights_mib=weight_bytes(engine) / 2**20,
               kv_mib=kv_bytes(model.config, len(prompts), slots, numerics) / 2**20)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["quickstart", "smollm2"], choices=["quickstart", "smollm2"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_engines")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{machine()}; {args.prompts} prompts x {args.new} new tokens at T = 1, seeds {args.seeds}; "
          "mismatch: mean [95% t-interval] over seeds; trainer f32\n")
    summary = {}
    for name in args.models:
        model, prompts, stops = quickstart(args.out, args.prompts) if name == "quickstart" else smollm2(args.prompts)
        rows = {label: measure(model, prompts, stops, numerics, args.seeds, args.new)
                for label, numerics in SETTINGS.items()}
        base = rows["f32"]["tokens_per_s"]
        print(f"### {name}\n")
        print("| engine | mean abs(Δlogp) | k3 KL | outside [0.5, 2] | ratio q01 / q99 | decode tok/s (× f32) "
              "| weights MiB | KV MiB |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for label, r in rows.items():
            cell = lambda v, f: f"{v[0]:{f}} [{v[1]:{f}}, {v[2]:{f}}]"  # noqa: E731
            print(f"| {label} | {cell(r['abs_dlogp'], '.4f')} | {cell(r['kl_k3'], '.1e')} | "
                  f"{r['outside'][0]:.2%} | {r['q01'][0]:.3f} / {r['q99'][0]:.3f} | "
                  f"{r['tokens_per_s']:.0f} ({r['tokens_per_s'] / base:.2f}) | {r['weights_mib']:.1f} | "
                  f"{r['kv_mib']:.2f} |")
        print()
        summary[name] = rows
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"written to {args.out / 'summary.json'}")


if __name__ == "__main__":
    main()
