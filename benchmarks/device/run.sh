#!/usr/bin/env bash
# The accelerator benchmark (bench_device.py): run from anywhere, on the machine's own JAX.
#   benchmarks/device/run.sh [--size full|tiny] [--out result.json]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PY="${PYTHON:-python3}"
if ! "$PY" -c "import jax" 2>/dev/null; then
  echo "error: $PY cannot import jax; install the JAX build for this accelerator (e.g. jax[cuda12] or jax[tpu])" >&2
  exit 2
fi
missing=$("$PY" -c "
import importlib.util
print(' '.join(m for m in ('flax', 'optax', 'chex', 'numpy', 'scipy', 'httpx') if importlib.util.find_spec(m) is None))")
if [ -n "$missing" ]; then
  echo "error: missing Python packages: $missing (pip install -e $ROOT, or those packages)" >&2
  exit 2
fi
cd "$ROOT"
PYTHONPATH="$ROOT:$ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" benchmarks/device/bench_device.py "$@"
