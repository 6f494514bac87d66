"""How to run sglang-jax (SGLang's JAX port) as a CPU server the bridge can launch: the
environment variables and the launch command template for `ServerGroup` / `rollout.launch`.
The environment itself is built by `tools/sglang_jax_env.py`, which says why each setting is
needed."""

from __future__ import annotations

import os
from pathlib import Path

# XLA_FLAGS cleared: a parent's simulated device count must not reach the server
ENV = {"JAX_PLATFORMS": "cpu", "FLAX_PYTREE_MODULE": "False", "XLA_FLAGS": ""}
DEFAULT_VENV = Path(__file__).resolve().parent.parent / ".sglang-jax-venv"
# sglang-jax 0.1.0rc0, for MoE servers that return routed experts (tools/sglang_jax_env.py)
ROUTED_EXPERTS_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
ROUTED_EXPERTS_VENV = Path(__file__).resolve().parent.parent / ".sglang-jax-moe-venv"
ROUTED_EXPERTS_FLAGS = ("--enable-return-routed-experts", "--grammar-backend", "none")


def python(venv: str | os.PathLike | None = None, *, routed_experts: bool = False) -> Path:
    """The sglang-jax environment's interpreter: `venv`, $OPD_JAX_SGLANG_VENV, or
    .sglang-jax-venv beside the package (routed_experts: $OPD_JAX_SGLANG_MOE_VENV or
    .sglang-jax-moe-venv)."""
    if routed_experts:
        root = Path(venv or os.environ.get("OPD_JAX_SGLANG_MOE_VENV") or ROUTED_EXPERTS_VENV)
        build = f"python tools/sglang_jax_env.py --routed-experts {root}"
    else:
        root = Path(venv or os.environ.get("OPD_JAX_SGLANG_VENV") or DEFAULT_VENV)
        build = f"python tools/sglang_jax_env.py {root}"
    path = root / "bin" / "python"
    if not path.exists():
        raise FileNotFoundError(f"no sglang-jax environment at {root}; build it with `{build}`")
    return path


def command(interpreter: str | os.PathLike, *, dtype: str = "float32", max_running_requests: int = 64,
            max_total_tokens: int = 16384, context_length: int | None = None, extra: tuple[str, ...] = (),
            routed_experts: bool = False) -> list[str]:
    """Launch template with {model_path}, {host} and {port} left for ServerGroup to fill
    (routed_experts: a 0.1 server that returns them; run it with ROUTED_EXPERTS_ENV)."""
    bs = [str(b) for b in (1, 4, 16, 64, 256) if b < max_running_requests] + [str(max_running_requests)]
    argv = [str(interpreter), "-m", "sgl_jax.launch_server", "--model-path", "{model_path}", "--host", "{host}",
            "--port", "{port}", "--device", "cpu", "--dtype", dtype, "--random-seed", "0",
            "--max-running-requests", str(max_running_requests), "--max-total-tokens", str(max_total_tokens),
            "--precompile-bs-paddings", *bs, "--precompile-token-paddings", "64", "256", "1024",
            "--chunked-prefill-size", "1024", "--disable-overlap-schedule", "--skip-server-warmup",
            "--log-level", "warning"]
    if context_length:
        argv += ["--context-length", str(context_length)]
    if routed_experts:
        argv += ROUTED_EXPERTS_FLAGS
    return argv + list(extra)
