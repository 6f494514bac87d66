"""The prepared accelerator benchmark (benchmarks/device/run.sh) runs end to end at its tiny
size on this CPU, so it does not rot before a machine with an accelerator runs it."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from xla_env import xla_flags

ROOT = Path(__file__).parents[1]


def test_the_device_benchmark_runs_at_tiny_size(tmp_path):
    out = tmp_path / "device.json"
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "device" / "run.sh"), "--size", "tiny", "--out", str(out)],
                            capture_output=True, text=True, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin",
                                                                 "XLA_FLAGS": xla_flags(1),
                                                                 "JAX_PLATFORMS": "cpu",
                                                                 **{k: v for k, v in os.environ.items()
                                                                    if k.startswith("JAX_") and "CACHE" in k}},
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["backend"] == "cpu" and report["size"] == "tiny" and report["roofline_tflops"] > 0
    step = report["ppo_step"]
    assert step["packed"]["rows"] < step["padded"]["rows"] == step["batch"]
    for kind in ("padded", "packed"):
        assert 0 < step[kind]["mfu"] <= 1 and step[kind]["tokens_per_s"] > 0
    assert math.isclose(step["packed_speedup"], step["padded"]["step_s"] / step["packed"]["step_s"])
    assert set(report["decode"]) == {"static_batch_4", "static_batch_8", "ragged_static_4_slots",
                                     "ragged_continuous_4_slots"}
    assert all(v["tokens_per_s"] > 0 for v in report["decode"].values())


def test_the_device_benchmark_says_what_is_missing(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "device" / "run.sh")], capture_output=True, text=True,
                            env={"PYTHON": str(fake), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2 and "cannot import jax" in result.stderr
