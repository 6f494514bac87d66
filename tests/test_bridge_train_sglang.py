"""`opd-jax train ... rollout.engine=sglang`: the PPO loop end to end against sglang-jax servers
the bridge launches, refitting them (by restart: sglang-jax has no update_weights_from_disk)
after every step. An f32 server must agree with the f32 trainer's rescoring."""

from __future__ import annotations

import json
import sys

import yaml
from sglang_setup import sglang_python
from test_cli_train import run_cli
from train_loop_settings import TINY

from rollout_bridge import sglang_jax

HEAD_DIM_128 = ["model.fresh.hidden_size=256", "model.fresh.intermediate_size=512", "model.fresh.head_dim=128"]


# prompts and multi-turn episodes (the search game) mixed: each turn continues the episode's token ids
MIXED = ["data.train=[{builtin: max, params: {hi: 9, min_len: 3, max_len: 3}}, "
         "{environment: search, params: {hi: 3, max_guesses: 3}, eval_prompts: 1}]", "rollout.episodes.max_tokens=48"]


def test_ppo_loop_runs_against_launched_sglang_servers(tmp_path):
    """Single-turn prompts and multi-turn episodes through the servers: the f32 server's log-probs
    of every model token (episode turns included) are the trainer's; its greedy held-out episodes
    are the embedded engine's, turn for turn."""
    config = {"rollout": {"engine": "sglang", "sglang": {"launch": {
        "command": sglang_jax.command(sglang_python(), max_running_requests=16), "env": sglang_jax.ENV}}}}
    path = tmp_path / "sglang.yaml"
    path.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    settings = [*TINY, *HEAD_DIM_128, *MIXED, "sft.steps=1", "data.eval_prompts_per_domain=8", "checkpoint.every=2"]
    result = run_cli(["train", path, *settings, "steps=2", f"logging.run_dir={run}", "logging.eval_every=2"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["mismatch_abs_logp_diff"] < 1e-4, row["mismatch_abs_logp_diff"]
        assert row["mismatch_outside_band_frac"] == 0.0 and row["rollout/refit_s"] > 0
        assert row["rollout/failed_groups"] == 0 and row["rollout/server_crashes"] == 0
        assert row["rollout/staleness"] == 0.0
        assert row["episodes/failed"] == 0 and row["episodes/turns"] >= 1
    assert "eval/accuracy" in rows[-1]
    embedded = tmp_path / "embedded"
    result = run_cli(["train", *settings, "steps=1", f"logging.run_dir={embedded}", "logging.eval_every=1"])
    assert result.exit_code == 0, result.output
    twin = json.loads((embedded / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("eval/search/accuracy", "eval/search/turns", "eval/max/accuracy"):
        assert rows[0][key] == twin[key], key
    assert rows[0]["eval/search/turns"] > 1
    assert sorted(p.name for p in (run / "refit").iterdir()) == ["v0", "v1", "v2"]
    assert list((run / "sglang_logs").glob("server_*.log"))


def test_a_server_that_will_not_start_stops_the_run_with_its_log(tmp_path):
    crash = [sys.executable, "-c", "import sys; print('no such model: ' + sys.argv[1]); sys.exit(3)",
             "{model_path}", "{port}"]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"rollout": {"engine": "sglang", "sglang": {"launch": {"command": crash}}}}))
    result = run_cli(["train", path, *TINY, "steps=1", "sft.steps=0", f"logging.run_dir={tmp_path / 'run'}"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "did not start" in result.output and "exited with code 3" in result.output
    assert "no such model" in result.output
