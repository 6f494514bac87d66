"""Build the Python 3.12 virtual environment that runs the real sglang-jax server for the
rollout_bridge tests, benchmarks and notebooks: `python tools/sglang_jax_env.py [VENV_DIR]`.

sglang-jax 0.0.2 (the newest on PyPI) needs Python >= 3.12 and pins jax 0.8. Six things stop
its CPU path from serving `return_logprob` requests as published; each is mended below by an
exact source edit that fails loudly if the file differs from the one it was written against:

1. flax >= 0.12 makes every nnx.Module a pytree, and sglang-jax registers its attention backends
   again (duplicate registration). The server runs with FLAX_PYTREE_MODULE=False (the launch
   command sets it), with flax pinned to 0.12.0, where that flag still allows `with mesh:`.
2. The CPU top-k/top-p sampler passes three operands to a two-operand min-p filter.
3. The sampler's PRNG key is nnx state read inside jit, so every decode step of every request
   draws the same random numbers (identical samples for a group of identical prompts). The
   model runner now folds a call counter into the key.
4. With return_logprob, prefill logits are not padded to the batch the sampler is padded to,
   and the sampled tokens' logprobs are written onto a pytree inside jit, so they never reach
   the scheduler. The sampler now returns them and the model runner stores them.
5. An untied LM head is always created in bf16, whatever --dtype says, so an f32 server's
   logprobs were bf16-rounded. It now takes the model's dtype (llama, qwen2, qwen3).
6. The overlap scheduler hands the scheduler lists where it asserts tuples, so the server runs
   with --disable-overlap-schedule; and logprobs leave as numpy scalars that the streaming
   encoder cannot write, so they are turned into Python floats.

A second environment, `python tools/sglang_jax_env.py --routed-experts [VENV_DIR]` (default
.sglang-jax-moe-venv), holds sglang-jax 0.1.0rc0: the first release that serves Qwen3-MoE with
`return_routed_experts` (routing replay). It runs with flax modules as pytrees and without the
grammar backend (which cannot read the character tokenizer); its stream encoder gets numpy
scalars (logprobs) it cannot write, mended as in 6. Its dense path fails on the CPU (KV-cache
sharding), so the dense tests stay on 0.0.2.

Idempotent: a marker file records the pinned versions and the patch set.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

PINS = ["sglang-jax==0.0.2", "flax==0.12.0", "jax[tpu]==0.8.3", "jaxlib==0.8.3", "typing-extensions~=4.14.1"]

ROUTED_EXPERTS_PINS = ["sglang-jax[cpu]==0.1.0rc0"]
ROUTED_EXPERTS_PATCHES: list[tuple[str, str, str]] = [
    ("sgl_jax/srt/entrypoints/http_server.py",
     f"\n{indent}yield (b\"data: \" + orjson.dumps(out, option=orjson.OPT_NON_STR_KEYS)",
     f"\n{indent}yield (b\"data: \" + orjson.dumps(out, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)")
    for indent in (" " * 20, " " * 16)
]

PATCHES: list[tuple[str, str, str]] = [
    ("sgl_jax/srt/layers/sampler.py",
     "    min_p_operands = (probs_sort, min_ps, False)\n",
     "    min_p_operands = (probs_sort, min_ps)\n"),
    ("sgl_jax/srt/layers/logits_processor.py",
     "        sampled_logits = logits[sample_indices] if sample_indices is not None else logits\n",
     "        sampled_logits = logits[sample_indices] if sample_indices is not None else logits\n"
     "        if sample_indices is not None and logits_metadata.extend_seq_lens is not None:\n"
     "            padded = logits_metadata.extend_seq_lens.shape[0]\n"
     "            sampled_logits = jnp.pad(sampled_logits, ((0, padded - sampled_logits.shape[0]), (0, 0)))\n"),
    ("sgl_jax/srt/layers/sampler.py",
     "        lax.cond(\n"
     "            sampling_metadata.return_logprob,\n"
     "            self._process_logprob_results,\n"
     "            lambda operands: None,\n"
     "            logprob_operands,\n"
     "        )\n\n"
     "        return batch_next_token_ids\n",
     "        del logprob_operands\n"
     "        chosen = logprobs[jnp.arange(batch_next_token_ids.shape[0]), batch_next_token_ids]\n"
     "        return batch_next_token_ids, chosen\n"),
    ("sgl_jax/srt/model_executor/model_runner.py",
     "        return self.jitted_sampler(\n"
     "            logits_output,\n"
     "            sampling_metadata,\n"
     "            positions,\n"
     "        )\n",
     "        self._opd_sample_calls = getattr(self, '_opd_sample_calls', 0) + 1\n"
     "        next_token_ids, chosen_logprobs = self.jitted_sampler(\n"
     "            logits_output,\n"
     "            sampling_metadata,\n"
     "            positions,\n"
     "            np.int32(self._opd_sample_calls),\n"
     "        )\n"
     "        logits_output.next_token_logprobs = chosen_logprobs\n"
     "        return next_token_ids\n"),
    ("sgl_jax/srt/layers/sampler.py",
     "        positions: jax.Array,\n    ):\n",
     "        positions: jax.Array,\n        call_index: jax.Array = 0,\n    ):\n"),
    ("sgl_jax/srt/layers/sampler.py",
     "        _, rng = jax.random.split(self.rngs.params())\n",
     "        _, rng = jax.random.split(self.rngs.params())\n"
     "        rng = jax.random.fold_in(rng, call_index)\n"),
    *[(f"sgl_jax/srt/models/{name}.py", f"ParallelLMHead({vocab}, config.hidden_size, rngs=rngs)",
       f"ParallelLMHead({vocab}, config.hidden_size, rngs=rngs, dtype=dtype, param_dtype=dtype)")
      for name, vocab in [("llama", "config.vocab_size"), ("qwen2", "config.vocab_size"), ("qwen3", "config.vocab_size")]],
    *[("sgl_jax/srt/managers/scheduler_output_processor_mixin.py", old, old.replace(".astype(float)", ".astype(float).tolist()"))
      for old in ["                    logits_output.next_token_logprobs = jax.device_get(\n"
                  "                        logits_output.next_token_logprobs\n"
                  "                    ).astype(float)\n",
                  "                        jax.device_get(logits_output.input_token_logprobs).astype(float)\n"]],
    ("sgl_jax/srt/managers/scheduler_output_processor_mixin.py",
     "                next_token_logprobs = jax.device_get(logits_output.next_token_logprobs).astype(\n"
     "                    float\n"
     "                )\n",
     "                next_token_logprobs = jax.device_get(logits_output.next_token_logprobs).astype(\n"
     "                    float\n"
     "                ).tolist()\n"),
]


def python312() -> str:
    """A Python 3.12 interpreter: $OPD_JAX_PYTHON312, `python3.12` on PATH, or pyenv's 3.12."""
    candidates = [os.environ.get("OPD_JAX_PYTHON312"), shutil.which("python3.12"),
                  *sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))]
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == "True":
            return candidate
    raise SystemExit("sglang-jax needs Python 3.12; none found (set OPD_JAX_PYTHON312 to its path)")


def signature(pins: list[str], patches: list[tuple[str, str, str]]) -> str:
    return hashlib.sha256(repr((pins, patches)).encode()).hexdigest()[:16]


def apply_patches(site_packages: Path, patches: list[tuple[str, str, str]]) -> None:
    for relative, old, new in patches:
        path = site_packages / relative
        text = path.read_text()
        if new in text and old not in text:
            continue
        if text.count(old) != 1:
            raise SystemExit(f"{path}: the code this patch mends is not there as expected; "
                             f"sglang-jax is not the pinned version")
        path.write_text(text.replace(old, new))


def build(venv: Path, routed_experts: bool = False) -> Path:
    """Create (or reuse) the environment; returns its python."""
    pins, patches = (ROUTED_EXPERTS_PINS, ROUTED_EXPERTS_PATCHES) if routed_experts else (PINS, PATCHES)
    python = venv / "bin" / "python"
    marker = venv / ".opd_jax_env"
    if marker.exists() and marker.read_text() == signature(pins, patches) and python.exists():
        return python
    if not python.exists():
        subprocess.run([python312(), "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *pins], check=True)
    site = subprocess.run([str(python), "-c", "import sgl_jax, pathlib; print(pathlib.Path(sgl_jax.__file__).parent.parent)"],
                          check=True, capture_output=True, text=True).stdout.strip()
    apply_patches(Path(site), patches)
    marker.write_text(signature(pins, patches))
    return python


if __name__ == "__main__":
    args = sys.argv[1:]
    moe = "--routed-experts" in args
    args = [a for a in args if a != "--routed-experts"]
    default = ".sglang-jax-moe-venv" if moe else ".sglang-jax-venv"
    print(build(Path(args[0] if args else default).resolve(), routed_experts=moe))
