"""Ten LoRA teachers scoring one merge step's rows, three ways side by side in one run: ten
merged models (a full copy each, a call per teacher), one shared base with a call per teacher
(each call runs its teacher's adapter), and one bank (the base once, all rows in one call, each
row with its teacher's adapter: `models.lora.project`'s rows). Teacher memory (what
`LocalTeachers` places, `report.json`'s teachers_gib) and the time of one `score` over the rows,
best of `--repeats`.

    python benchmarks/bench_lora_teachers.py [--models quickstart smollm2] [--repeats 3]

The teachers: rank 16 on every projection (α 32, configs/recipe_lora.yaml's), B drawn at random
(as after training). quickstart: configs/quickstart.yaml's 0.6M Llama, 64 rows of 24 + 20 tokens
(the recipe's step: 64 prompts, 20 new tokens), the loss `full` (every position's distribution,
as the recipe). smollm2: SmolLM2-135M-Instruct in float32, 32 rows of 64 + 64 tokens, `top_k`
32 (the vocabulary's full distribution on 32 rows would be 0.8 GB a call). Each row's teacher is
drawn at random (seed 0), as a merge step's domains are. Every call pads its rows to a power of
two (`LocalTeachers`' buckets), so a bank pays for one bucket and the calls per teacher for ten.
One CPU device; writes benchmarks/results/lora_teachers.json.
"""

from __future__ import annotations

import jax
import numpy as np
from bench_common import best_time, measure_models
from bench_critic_free import ROOT, batch_of, model_arguments, policy_of
from flax import nnx

from opd_jax.merge.teachers import LocalTeachers
from opd_jax.models import Decoder
from opd_jax.models.lora import LoraConfig, merged_params
from opd_jax.models.weights import build_from_params
from opd_jax.parallel import MeshConfig, make_mesh

TEACHERS = 10
LORA = LoraConfig(rank=16, alpha=32.0)
SETTINGS = {"quickstart": ((64, 24, 20), "full"), "smollm2": ((32, 64, 64), "top_k")}  # (rows, prompt, response), loss


def adapted_teachers(name: str) -> list[Decoder]:
    """TEACHERS models on one base's arrays, each with its own adapters (random B)."""
    base = policy_of(name)
    pure = nnx.to_pure_dict(nnx.state(base, nnx.Param))
    teachers = []
    for i in range(TEACHERS):
        model = build_from_params(Decoder, base.config, pure, compute_dtype=base.backbone.compute_dtype)
        model.add_lora(LORA, nnx.Rngs(i))
        keys = iter(jax.random.split(jax.random.key(100 + i), 64))
        for key, var in vars(model.backbone.layers).items():
            if key.endswith("_lora_b"):
                var[...] = 0.02 * jax.random.normal(next(keys), var[...].shape, var[...].dtype)
        teachers.append(model)
    return teachers


def merged(model: Decoder) -> Decoder:
    config, pure = merged_params(model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return build_from_params(Decoder, config, pure, compute_dtype=model.backbone.compute_dtype)


def measure(name: str, repeats: int) -> dict:
    shape, loss = SETTINGS[name]
    teachers = adapted_teachers(name)
    batch = batch_of(teachers[0].config.vocab_size, *shape)
    index = np.random.default_rng(0).integers(0, TEACHERS, shape[0])  # a merge step's rows: domains drawn at random
    mesh = make_mesh(MeshConfig())
    names = [f"t{i}" for i in range(TEACHERS)]
    ways = {"ten merged models": ([merged(t) for t in teachers], False),
            "one base, a call per teacher": (teachers, False),
            "one base, one bank": (teachers, True)}
    out, scores = {}, {}
    for label, (models, banks) in ways.items():
        local = LocalTeachers(names, models, mesh, loss=loss, banks=banks)
        scores[label] = local.score(batch, index)["logp_teacher"]
        out[label] = {"teachers_gib": local.nbytes / 2**30, "calls": len(local.groups),
                      "score_s": best_time(lambda: local.score(batch, index), repeats)}
        local.close()
    first = out["ten merged models"]
    for label in ways:
        out[label]["memory_vs_merged"] = out[label]["teachers_gib"] / first["teachers_gib"]
        out[label]["time_vs_merged"] = out[label]["score_s"] / first["score_s"]
        # the three ways score the same rows alike (float rounding apart)
        out[label]["max_abs_logp_diff"] = float(np.max(np.abs(scores[label] - scores["ten merged models"])))
    out["shape"] = {"rows": shape[0], "prompt": shape[1], "response": shape[2], "loss": loss, "teachers": TEACHERS}
    return out


def main() -> None:
    args = model_arguments(__doc__)
    results = measure_models(measure, args.models, args.repeats, ROOT / "benchmarks" / "results" / "lora_teachers.json")
    print("| model | teachers | calls | teachers GiB (× merged) | score s (× merged) | max |Δ logp| |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, r in results["models"].items():
        for label, x in r.items():
            if label != "shape":
                print(f"| {name} | {label} | {x['calls']} | {x['teachers_gib']:.4f} ({x['memory_vs_merged']:.2f}×) | "
                      f"{x['score_s']:.3f} ({x['time_vs_merged']:.2f}×) | {x['max_abs_logp_diff']:.1e} |")


if __name__ == "__main__":
    main()
