"""`opd-jax merge` with its teachers behind real sglang-jax servers that the merge launches (one
per teacher, f32): each teacher scores the student's tokens through the bridge (prompt
log-probs, max_new_tokens=0), and the merge equals the same merge with the teachers as local
JAX models on the mesh."""

from __future__ import annotations

import json

import jax
import numpy as np
import yaml
from flax import nnx
from sglang_setup import save_tiny, sglang_python

from opd_jax.config import MergeConfig, load_config
from opd_jax.merge import merge
from opd_jax.models import load_model
from rollout_bridge import sglang_jax

TIMING = ("rollout/tokens_per_s", "rollout/wait_s", "rollout/refit_s")


def test_teachers_on_sglang_servers_equal_local_teachers(tmp_path):
    for seed, name in enumerate(("student", "max", "parity")):
        save_tiny(tmp_path / name, seed)
    common = [f"student.path={tmp_path / 'student'}",
              f"teachers.paths={{max: {tmp_path / 'max'}, parity: {tmp_path / 'parity'}}}",
              "data.train=[{builtin: max, params: {hi: 9}}, {builtin: parity, params: {max_len: 5}}]",
              "steps=2", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "data.prompts_per_step=4",
              "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "data.eval_prompts_per_domain=4",
              "optimizer.learning_rate=1e-2", "logging.eval_every=2", "logging.progress_bar=false",
              "logging.tensorboard=false", "logging.plot=false", "checkpoint.every=2",
              "baselines.weight_average=false", "baselines.task_arithmetic=false"]
    launched = tmp_path / "sglang.yaml"
    launched.write_text(yaml.safe_dump({"teachers": {"engine": "sglang", "sglang": {"launch": {
        "command": sglang_jax.command(sglang_python(), max_running_requests=16), "env": sglang_jax.ENV}}}}))
    on_servers = merge(load_config(launched, [*common, f"logging.run_dir={tmp_path / 'sglang'}"], schema=MergeConfig))
    local = merge(load_config(None, [*common, f"logging.run_dir={tmp_path / 'local'}"], schema=MergeConfig))

    rows = lambda run: [{k: v for k, v in json.loads(line).items() if k not in TIMING}  # noqa: E731
                        for line in (run / "metrics.jsonl").read_text().splitlines()]
    served, here = rows(on_servers), rows(local)
    assert [r["step"] for r in served] == [0, 1, 2]
    for a, b in zip(served, here):
        assert a.keys() == b.keys()
        for key in a:  # the teachers' log-probs agree to < 1e-4 per token, so every statistic does
            np.testing.assert_allclose(a[key], b[key], rtol=1e-3, atol=1e-4, err_msg=key)
    assert {"opd/reverse_kl/max", "opd/reverse_kl/parity"} <= set(served[1]) | set(served[2])
    params = lambda run: jax.tree.leaves(nnx.state(load_model(run / "student")[0], nnx.Param))  # noqa: E731
    start = jax.tree.leaves(nnx.state(load_model(tmp_path / "student")[0], nnx.Param))
    for a, b, s in zip(params(on_servers), params(local), start):  # Adam: compare whole updates, not entries
        du, dr = np.asarray(a) - np.asarray(s), np.asarray(b) - np.asarray(s)
        assert np.linalg.norm(du - dr) <= 1e-2 * np.linalg.norm(dr), np.linalg.norm(du - dr) / np.linalg.norm(dr)
    for teacher in ("max", "parity"):  # one server group per teacher, each with its own log
        assert list((on_servers / "sglang_logs" / teacher).glob("server_*.log"))
