"""`opd-jax train` from the command line: a short real run, and config errors that name the key."""

import json
from pathlib import Path

from train_loop_settings import TINY
from typer.testing import CliRunner

from opd_jax.cli import app

QUICKSTART = Path(__file__).parents[1] / "configs" / "quickstart.yaml"


def run_cli(args):
    return CliRunner().invoke(app, list(map(str, args)), env={"COLUMNS": "1000"})


def test_train_runs_and_writes_its_run_directory(tmp_path):
    result = run_cli(["train", *TINY, "steps=2", "sft.steps=1", f"logging.run_dir={tmp_path}",
                      "logging.eval_every=2"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/accuracy" in rows[-1] and "reward_mean" in rows[-1]
    again = run_cli(["train", *TINY, "steps=2", f"logging.run_dir={tmp_path}"])
    assert again.exit_code == 2 and "holds a finished `opd-jax train` run" in again.output


def test_config_errors_name_the_key(tmp_path):
    result = run_cli(["train", QUICKSTART, "algorithm.ppo.epz=1"])
    assert result.exit_code == 2 and "algorithm.ppo.epz: unknown key" in result.output
    result = run_cli(["train", "rollout.temperature=hot"])
    assert result.exit_code == 2 and "rollout.temperature: Input should be a valid number" in result.output
