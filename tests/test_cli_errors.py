"""The CLI speaks to people: each user error is one `error: ...` line naming the problem, exit
status 2 and no traceback; --debug shows the traceback; a real bug keeps its traceback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from flax import nnx
from train_loop_settings import TINY
from typer.testing import CliRunner

import opd_jax.train
from opd_jax.cli import app
from opd_jax.models import Decoder, ModelConfig, save_model
from opd_jax.models.char_tokenizer import char_tokenizer


def run_cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "1000"})


def assert_user_error(result, *needles):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    lines = [line for line in result.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, result.output  # a run that started prints its notes before the error
    for needle in needles:
        assert needle in result.output, (needle, result.output)


def test_bad_config_value_and_unknown_key(tmp_path):
    assert_user_error(run_cli("train", "rollout.temperature=hot"), "rollout.temperature: Input should be a valid number")
    assert_user_error(run_cli("train", "algorithm.ppo.epz=1"), "algorithm.ppo.epz: unknown key")
    assert_user_error(run_cli("train", tmp_path / "missing.yaml"), "no such config file")
    assert_user_error(run_cli("train", "data.prompts_per_step=3", "rollout.samples_per_prompt=1",
                                      "algorithm.ppo.update.minibatches=2"),
                      "does not split into 2 mini-batches")


def test_override_and_config_file_errors_name_their_source_and_the_nearest_key(tmp_path):
    result = run_cli("train", "algorithm.ppo.surrogate.eps_hi=0.3", "rollout.samples_per_prompt=abc")
    assert_user_error(result, "override 'algorithm.ppo.surrogate.eps_hi=0.3': algorithm.ppo.surrogate.eps_hi: "
                              "unknown key (did you mean algorithm.ppo.surrogate.eps_high?)",
                      "override 'rollout.samples_per_prompt=abc': rollout.samples_per_prompt: Input should be a "
                      "valid integer")
    config = tmp_path / "typo.yaml"
    config.write_text("steps: 3\nrollot: {temperature: 1.0}\n")
    assert_user_error(run_cli("train", config), f"invalid config {config}", "rollot: unknown key (did you mean rollout?)")
    assert_user_error(run_cli("train", "zzz_nothing_like_it=1"), "zzz_nothing_like_it: unknown key")
    assert "did you mean" not in run_cli("train", "zzz_nothing_like_it=1").output


def test_missing_model(tmp_path):
    missing = tmp_path / "no_such_model"
    assert_user_error(run_cli("train", *TINY, f"model.path={missing}", "model.fresh=null",
                              f"logging.run_dir={tmp_path / 'run'}"), str(missing), "does not exist")
    assert_user_error(run_cli("generate", missing, "-p", "hi"), "no such file or directory")


def test_bad_mesh_size(tmp_path):
    assert_user_error(run_cli("train", *TINY, "mesh.data=3", f"logging.run_dir={tmp_path / 'run'}"),
                      "mesh (data=3", "8 are available")
    assert_user_error(run_cli("train", *TINY, "data.prompts_per_step=3", "rollout.samples_per_prompt=2",
                              f"logging.run_dir={tmp_path / 'run2'}"),
                      "6 rollouts per step", "4 data-parallel shards")


def test_bad_data_file(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": oops}\n')
    assert_user_error(run_cli("train", *TINY, f"data.train=[{{jsonl: {data}}}]", "sft.steps=0", "steps=1",
                              f"logging.run_dir={tmp_path / 'run'}"), f"{data}:2")


def test_incompatible_teacher(tmp_path):
    tokenizer = char_tokenizer()
    config = ModelConfig(family="llama", vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                         num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16, max_position_embeddings=128,
                         eos_token_ids=(tokenizer.eos_token_id,))
    save_model(Decoder(config, rngs=nnx.Rngs(0)), tmp_path / "student", tokenizer)
    bigger = ModelConfig(**{**config.__dict__, "vocab_size": config.vocab_size + 1})
    save_model(Decoder(bigger, rngs=nnx.Rngs(1)), tmp_path / "teacher", tokenizer)
    result = run_cli("merge", "/dev/null", f"student.path={tmp_path / 'student'}",
                     f"teachers.paths={{max: {tmp_path / 'teacher'}}}", "data.train=[{builtin: max}]",
                     "mesh.data=-1", f"logging.run_dir={tmp_path / 'merge'}")
    assert_user_error(result, "teacher 'max' has a vocabulary of")


def test_engine_that_will_not_start(tmp_path):
    crash = tmp_path / "crash.yaml"
    crash.write_text(f"rollout:\n  engine: sglang\n  sglang:\n    launch:\n      command: [{sys.executable}, -c, "
                     "'import sys; sys.exit(3)', '{model_path}', '{port}']\n")
    assert_user_error(run_cli("train", crash, *TINY, "steps=1", f"logging.run_dir={tmp_path / 'run'}"),
                      "did not start", "exited with code 3")


def test_debug_shows_the_traceback_and_bugs_keep_theirs(tmp_path, monkeypatch):
    result = CliRunner().invoke(app, ["--debug", "train", "rollout.temperature=hot"], env={"COLUMNS": "1000"})
    assert result.exit_code == 2, result.output  # a user error stays one, with its traceback shown too
    assert result.output.startswith("Traceback") and "ConfigError" in result.output
    assert result.output.index("\nerror: override 'rollout.temperature=hot'") > result.output.index("ConfigError")

    def bug(*args, **kwargs):
        raise KeyError("a bug")
    monkeypatch.setattr(opd_jax.train, "train", bug)
    result = run_cli("train", *TINY, f"logging.run_dir={tmp_path / 'run'}")
    assert isinstance(result.exception, KeyError) and "error: " not in result.output


@pytest.mark.parametrize("key,needle", [
    ("algorithm.ppo.surrogate.eps_high", "clip-higher"),
    ("rollout.sglang.launch.command", "placeholders"),
])
def test_config_explain_and_show(key, needle, tmp_path):
    result = run_cli("config", "explain", key)
    assert result.exit_code == 0 and needle in result.output and key in result.output
    assert_user_error(run_cli("config", "explain", "algorithm.ppo.surogate"), "did you mean algorithm.ppo.surrogate")
    shown = run_cli("config", "show", "configs/quickstart.yaml", "rollout.samples_per_prompt=8")
    assert shown.exit_code == 0 and "samples_per_prompt: 8" in shown.output and "eps_high: 0.28" in shown.output


def test_unusable_run_directories_are_one_line(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    for run_dir, words in [(a_file, "it is a file, not a directory"), (a_file / "run", "Not a directory"),
                           ("/proc/opd_jax_cannot/run", "No such file or directory")]:
        assert_user_error(run_cli("train", *TINY, f"logging.run_dir={run_dir}"), f"cannot use {run_dir} as the run "
                          f"directory: {words}", "logging.run_dir")
    assert a_file.read_text() == "mine"


def test_a_command_that_trains_needs_a_config():
    for command in ("train", "sft"):
        result = run_cli(command)
        assert result.exit_code == 2 and "Traceback" not in result.output
        assert f"give a config file (e.g. opd-jax {command} configs/quickstart.yaml)" in result.output, result.output


def installed_command(*args, **kwargs):
    """The installed command as a user runs it (its main(): click's usage errors as one line too)."""
    return subprocess.run([sys.executable, "-m", "opd_jax.cli", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "1000"}, **kwargs)


def test_usage_errors_of_the_command_are_one_line(tmp_path):
    latin1 = tmp_path / "prompts.jsonl"
    latin1.write_bytes(b'{"prompt": "caf\xe9"}\n')
    cases = [
        (["generate", "smollm2-135m-instruct", "-p", "hi", "--dtype", "float64"],
         "error: Invalid value for '--dtype'", "'float64' is not one of 'float32', 'bfloat16', 'float16'"),
        (["generate", "smollm2-135m-instruct", "--input", latin1],
         "error: Invalid value for --input: line 1: not UTF-8 text (byte 0xe9 at column 16)", "opd-jax generate --help"),
        (["k8s", "render", "configs/quickstart.yaml", "--image", "i", "--queue", "q", "--out", tmp_path / "no" / "k.yaml"],
         f"error: --out {tmp_path / 'no' / 'k.yaml'}: its directory {tmp_path / 'no'} does not exist", ""),
        (["train"], "error: Invalid value for CONFIG: give a config file", "opd-jax train --help"),
        (["no-such-command"], "error: No such command 'no-such-command'", "opd-jax --help"),
        (["train", "--debug", "configs/quickstart.yaml"], "error: --debug goes before the command: opd-jax --debug train"),
    ]
    for args, *needles in cases:
        result = installed_command(*args, cwd=Path(__file__).parents[1])
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1 and not result.stdout, (args, result.stderr)
        assert all(n in lines[0] for n in needles), (args, lines[0])
    assert not (tmp_path / "no").exists()


def test_a_plugin_module_in_the_working_directory_is_found_by_the_installed_command(tmp_path):
    """The `opd-jax` console script's sys.path holds no working directory (python -m's does): a
    user's my_est.py beside the config is still found, and a missing one says where it looked."""
    import shutil

    (tmp_path / "my_est.py").write_text("from opd_jax.core.advantages import grpo_estimator as adv\n")
    command = shutil.which("opd-jax")
    assert command is not None
    config = Path(__file__).parents[1] / "configs" / "quickstart.yaml"
    shown = subprocess.run([command, "config", "show", str(config), "algorithm.ppo.advantage=my_est:adv"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert shown.returncode == 0 and "advantage: my_est:adv" in shown.stdout, shown.stderr
    missing = subprocess.run([command, "config", "show", str(config), "algorithm.ppo.advantage=nope_est:adv"],
                             capture_output=True, text=True, cwd=tmp_path)
    assert missing.returncode == 2 and f"looked in the installed packages and in the working directory {tmp_path}" \
        in missing.stderr, missing.stderr
