"""The embedded engine's prefix cache on single-turn groups: G samples of each prompt, with the
cache (the group's prompt prefilled once, its rows copies of it) and without (every row prefilled
in full), side by side in one run on the same prompts and keys.

    python benchmarks/bench_prefix_cache.py [--model smollm2] [--prompts 4] [--group 8] [--prompt-tokens 256]
                                            [--new 32] [--repeats 3]

smollm2: SmolLM2-135M-Instruct (the packaged GGUF, float32); quickstart: configs/quickstart.yaml's
fresh model. Timings: one `Sampler.generate` of prompts × group rows, best of `repeats` after a
compile. Prefill tokens: prompt tokens the batch computed, against what prefilling every row in
full computes. Writes benchmarks/results/prefix_cache_groups.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import numpy as np
from bench_common import best_time, machine

from opd_jax.config import load_config
from opd_jax.models import load_model, smollm2_gguf
from opd_jax.sampling import Sampler, SamplingParams
from opd_jax.train import build_model

ROOT = Path(__file__).parents[1]


def model_of(name: str):
    if name == "quickstart":
        return build_model(load_config(ROOT / "configs" / "quickstart.yaml").model)[0]
    return load_model(smollm2_gguf(), dtype="float32")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "quickstart"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = model_of(args.model)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, model.config.vocab_size, args.prompt_tokens)) for _ in range(args.prompts)]
    rows = [p for p in prompts for _ in range(args.group)]
    params = SamplingParams(max_new_tokens=args.new, temperature=1.0)
    keys = jax.random.split(jax.random.key(1), len(rows))
    out = {"machine": machine(), "model": args.model, "rows": len(rows), "prompt_tokens": args.prompt_tokens,
           "new_tokens": args.new}
    rollouts = {}
    for label, tokens in (("no cache", 0), ("prefix cache", 1_000_000)):
        sampler = Sampler(model, max_cache_len=args.prompt_tokens + args.new, prefix_cache_tokens=tokens)
        seconds = best_time(lambda s=sampler: s.generate(rows, params, keys), args.repeats)
        rollouts[label] = sampler.generate(rows, params, keys)
        saved = sampler.prefill_stats.take()["prefill_saved_frac"]
        out[label] = {"rollout_s": seconds, "prefill_saved_frac": saved}
    # a sample drawn near a boundary of its CDF may flip under a rounding-level logit change, and
    # the row's later tokens follow from it: compare log-probs up to each row's first difference
    identical, gap = 0, 0.0
    for a, b in zip(rollouts["no cache"], rollouts["prefix cache"]):
        first = next((t for t, (u, v) in enumerate(zip(a.output_ids, b.output_ids)) if u != v), len(a.output_ids))
        identical += first == len(a.output_ids) and a.output_ids == b.output_ids
        if first:  # the log-probs of the same tokens (a flipped token has another token's)
            gap = max(gap, float(np.max(np.abs(np.subtract(a.output_logprobs[:first], b.output_logprobs[:first])))))
    out["speedup"] = out["no cache"]["rollout_s"] / out["prefix cache"]["rollout_s"]
    out["rows_identical"], out["max_logprob_gap_until_first_difference"] = identical, gap
    (ROOT / "benchmarks" / "results" / "prefix_cache_groups.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
