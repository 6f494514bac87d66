"""Runs that cannot be mixed up or lost, driven through the CLI as a user drives it: each fault
and bad input is one line naming the problem (exit status 2, no traceback) and leaves the run
directory's files as they were; SIGTERM/SIGINT stop at a step boundary with a checkpoint and the
resumed run equals an uninterrupted one bit for bit; an unreadable latest checkpoint falls back
to the previous one; a full disk says so and leaves no partial checkpoint."""

import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from train_loop_settings import RESUME_ARGS, TINY, like_state
from typer.testing import CliRunner

from opd_jax.cli import app
from opd_jax.config import load_config
from opd_jax.train.checkpoint import Checkpoints
from opd_jax.train.metrics import read_metrics
from opd_jax.train.run_dir import checkpoint_steps, lock

# with pytest-xdist, one worker runs every test of conftest's straight_run (computed once per worker)
pytestmark = pytest.mark.xdist_group("straight_run")

# the loop tests' run (conftest's straight_run): 6 steps, checkpoints at 2, 4, 6 (3 kept)
RUN = [*TINY, *RESUME_ARGS]
TIMING = ("rollout/tokens_per_s", "rollout/wait_s", "rollout/refit_s")


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "1000"})


def one_line_error(result, *needles, started=False):
    """Exit status 2, no traceback, one `error: ` line holding every needle; the only line, unless
    the run had `started` (then its notes come before)."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = [line for line in result.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == lines[-1] and (started or len(lines) == 1), result.output
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


def hashes(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def state_of(run_dir: Path, like_dir: Path):
    """The final checkpoint's state and metadata, restored into the shapes of like_dir's config."""
    checkpoints = Checkpoints(run_dir / "checkpoints", keep=3)
    try:
        return checkpoints.restore(checkpoints.latest_step(), like_state(like_dir))
    finally:
        checkpoints.close()


def assert_same_run(a: Path, b: Path) -> None:
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    assert strip(read_metrics(a / "metrics.jsonl")) == strip(read_metrics(b / "metrics.jsonl"))
    (x, meta_x), (y, meta_y) = state_of(a, a), state_of(b, a)
    assert meta_x == meta_y and int(x.step) == int(y.step)
    for u, v in zip(jax.tree.leaves((x.policy, x.critic, x.policy_opt, x.critic_opt, x.reference)),
                    jax.tree.leaves((y.policy, y.critic, y.policy_opt, y.critic_opt, y.reference)), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.fixture
def straight(straight_run):
    """The uninterrupted run the interrupted ones must equal (shared: never written into)."""
    return straight_run


# -- run directories ---------------------------------------------------------------------------

def test_a_second_process_is_refused_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    holder = lock(run_dir, "train")  # another process's lock (flock: per open file, so this process too)
    try:
        before = hashes(run_dir)
        one_line_error(cli("train", *RUN, f"logging.run_dir={run_dir}"), "is in use by `opd-jax train`",
                       f"pid {os.getpid()}")
        assert hashes(run_dir) == before
    finally:
        holder.close()


def test_a_finished_run_is_never_written_into(straight):
    before = hashes(straight)
    one_line_error(cli("sft", *RUN, f"logging.run_dir={straight}"), "holds an `opd-jax train` run (finished)")
    one_line_error(cli("train", *RUN, f"logging.run_dir={straight}"), "holds a finished `opd-jax train` run")
    one_line_error(cli("train", *RUN, f"logging.run_dir={straight}", "--resume"), "has run 6 of 6 steps",
                   "nothing to resume")
    changed = cli("train", *RUN, f"logging.run_dir={straight}", "--resume", "steps=8", "model.fresh.hidden_size=32")
    assert changed.exit_code == 2 and "Traceback" not in changed.output
    assert changed.output.startswith("error: the resumed run's config changes model.fresh.hidden_size, which a "
                                     "resume cannot honour"), changed.output
    assert "model.fresh.hidden_size: 64 -> 32" in changed.output and "steps: 6 -> 8" in changed.output
    assert hashes(straight) == before


def test_a_run_killed_in_its_export_is_finished_by_resume(straight, tmp_path):
    """Killed after its last checkpoint (run.json still says running, the export not written):
    --resume trains no step and only finishes the export."""
    run_dir = tmp_path / "exporting"
    shutil.copytree(straight, run_dir)
    manifest = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**manifest, "status": "running"}))
    (run_dir / "memory.json").unlink()
    before = {k: v for k, v in hashes(run_dir).items()  # the checkpoints (not orbax's log) and the metrics
              if k.startswith("checkpoints/") and not k.endswith(".log") or k == "metrics.jsonl"}
    result = cli("train", *RUN, f"logging.run_dir={run_dir}", "--resume")
    assert result.exit_code == 0, result.output
    assert "trained all 6 steps but did not finish its export: finishing it" in result.output
    assert (run_dir / "memory.json").exists() and json.loads((run_dir / "run.json").read_text())["status"] == "finished"
    after = hashes(run_dir)
    assert all(after[k] == v for k, v in before.items())  # no step trained, no row logged


def test_resume_needs_a_run_to_resume(tmp_path):
    one_line_error(cli("train", *RUN, f"logging.run_dir={tmp_path / 'typo'}", "--resume"), "does not exist",
                   "nothing to resume")
    assert not (tmp_path / "typo").exists()
    (tmp_path / "empty").mkdir()
    one_line_error(cli("train", *RUN, f"logging.run_dir={tmp_path / 'empty'}", "--resume"), "holds no checkpoint")


def test_resume_with_a_changed_config_keeps_the_config_history(straight, tmp_path):
    run_dir = tmp_path / "longer"
    shutil.copytree(straight, run_dir)
    result = cli("train", *RUN, f"logging.run_dir={run_dir}", "--resume", "steps=8")
    assert result.exit_code == 0, result.output
    assert "resuming with a changed config" in result.output and "steps: 6 -> 8" in result.output
    assert load_config(run_dir / "config_history" / "1.yaml").steps == 6
    assert load_config(run_dir / "config_history" / "2.yaml").steps == 8
    assert load_config(run_dir / "config.yaml").steps == 8
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["status"] == "finished" and [a["resumed_from"] for a in manifest["attempts"]] == [None, 6]
    assert checkpoint_steps(run_dir)[-1] == 8
    # a model of another shape: refused unless forced, and forced, the checkpoint says what does not fit
    before = hashes(run_dir)
    forced = cli("train", *RUN, f"logging.run_dir={run_dir}", "--resume", "--force", "steps=10",
                 "model.fresh.hidden_size=32")
    lines = [line for line in forced.output.splitlines() if line.startswith("error: ")]
    assert forced.exit_code == 2 and "Traceback" not in forced.output and len(lines) == 1, forced.output
    assert "checkpoint step 8 does not fit this config" in lines[0] and "in the checkpoint" in lines[0], lines[0]
    assert "the config changed model.fresh.hidden_size 64 -> 32 since it was saved" in lines[0], lines[0]
    assert checkpoint_steps(run_dir) == [4, 6, 8] and (run_dir / "config.yaml").read_bytes() == \
        (run_dir / "config_history" / "2.yaml").read_bytes()
    saved = lambda files: {k: v for k, v in files.items() if "checkpoints/" in k and "orbax.log" not in k}  # noqa: E731
    assert saved(hashes(run_dir)) == saved(before)
    manifest = json.loads((run_dir / "run.json").read_text())  # refused: still the finished run it was
    assert manifest["status"] == "finished" and manifest["attempts"][-1]["status"] == "refused"
    # the KL term turned off: its reference is in the checkpoint, and the error says why it matters
    off = cli("train", *RUN, f"logging.run_dir={run_dir}", "--resume", "steps=10", "algorithm.ppo.kl.coef=0.0")
    one_line_error(off, "checkpoint step 8 does not fit this config", "the KL term was turned off",
                   "algorithm.ppo.kl.coef 0.01 -> 0.0", "keep it on", started=True)
    assert saved(hashes(run_dir)) == saved(before)


# -- faults ------------------------------------------------------------------------------------

def _signal_run(run_dir: Path, sig: int, wait_for: str, *extra: str) -> subprocess.CompletedProcess:
    """`opd-jax train` in its own process, sent `sig` once `wait_for` (a file of the run) has a line."""
    env = {**os.environ, "COLUMNS": "1000"}
    process = subprocess.Popen([sys.executable, "-m", "opd_jax.cli", "train", *RUN, f"logging.run_dir={run_dir}",
                                *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 1500
    target = run_dir / wait_for
    while not (target.exists() and target.read_text().strip()):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(sig)
    out, err = process.communicate(timeout=1500)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def _interrupted(moment: str, *args: str) -> subprocess.CompletedProcess:
    """`opd-jax ARGS` in its own process, interrupted at `moment` (tests/interrupt_at.py)."""
    return subprocess.run([sys.executable, str(Path(__file__).parent / "interrupt_at.py"), moment, *args],
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "1000"}, timeout=1800)


def test_sigterm_checkpoints_at_the_step_boundary_and_resumes_exactly(straight, tmp_path):
    run_dir = tmp_path / "run"
    # only the end is scheduled for a checkpoint: the one found after the signal is the signal's
    stopped = _signal_run(run_dir, signal.SIGTERM, "metrics.jsonl", "checkpoint.every=100")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert "Traceback" not in stopped.stderr
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("stopped: SIGTERM after step "), stopped.stderr
    step = int(last.split("after step ")[1].split()[0])
    assert 1 <= step < 6 and checkpoint_steps(run_dir) == [step]
    assert f"checkpoint saved (step {step})" in last
    assert json.loads((run_dir / "run.json").read_text())["status"] == "interrupted"
    hint = shlex.split(last.split("continue with: ")[1])
    assert hint[0] == "opd-jax" and "--resume" in hint
    resumed = cli(*hint[1:])  # the command it printed, as printed
    assert resumed.exit_code == 0, resumed.output
    assert_same_run(straight, run_dir)


def test_sigint_during_the_warm_start_checkpoints_it_and_the_resume_continues_it_exactly(tmp_path):
    """The warm start is a run of the one loop (RUN_DIR/warm_start/): a SIGINT in it saves its
    checkpoint at the step boundary; `--resume` continues it where it stopped and then trains;
    its losses equal those of `opd-jax sft` run straight to the same step, bit for bit."""
    run_dir = tmp_path / "run"
    stopped = _signal_run(run_dir, signal.SIGINT, "warm_start/metrics.jsonl", "sft.steps=100000")
    assert stopped.returncode == 128 + signal.SIGINT and "Traceback" not in stopped.stderr, stopped.stderr
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("stopped: SIGINT after warm start step "), last
    k = int(last.split("after warm start step ")[1].split()[0])
    assert checkpoint_steps(run_dir / "warm_start") == [k] and checkpoint_steps(run_dir) == []
    assert "--resume" in last.split("continue with: ")[1]
    one_line_error(cli("train", *RUN, f"logging.run_dir={run_dir}"), "already holds checkpoints (latest: warm start "
                   f"step {k}); pass --resume")
    resumed = cli("train", *RUN, f"logging.run_dir={run_dir}", f"sft.steps={k + 1}", "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
    straight = tmp_path / "sft"
    done = cli("sft", *RUN, f"logging.run_dir={straight}", f"sft.steps={k + 1}")
    assert done.exit_code == 0, done.output
    ours, theirs = (read_metrics(d / "metrics.jsonl") for d in (run_dir / "warm_start", straight))
    assert [r["step"] for r in ours] == list(range(1, k + 2))
    assert [r["sft/loss"] for r in ours] == [r["sft/loss"] for r in theirs]


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:100])


def _zero(file: Path) -> None:
    file.write_bytes(bytes(file.stat().st_size))


def _garbage_everywhere(file: Path) -> None:
    for each in file.parents[2].rglob("*"):  # every file of the checkpoint's state
        if each.is_file():
            each.write_bytes(b"\0garbage")


def test_ctrl_c_twice_during_a_save_stops_at_once_cleanly_with_a_hint_that_works(tmp_path):
    run_dir = tmp_path / "run"
    args = [*TINY, "steps=6", "checkpoint.every=2", "sft.steps=0", f"logging.run_dir={run_dir}"]
    stopped = _interrupted("save", "train", *args)
    assert stopped.returncode == 130, stopped.stderr
    lines = [line for line in stopped.stderr.splitlines() if line.strip()]
    assert "Traceback" not in stopped.stderr and "orbax" not in stopped.stderr.lower(), stopped.stderr
    assert lines[-1].startswith("stopped: SIGINT twice: stopped at once; the latest checkpoint is step 2; continue "
                                "with: opd-jax train --resume "), stopped.stderr
    assert json.loads((run_dir / "run.json").read_text())["status"] == "interrupted"
    assert checkpoint_steps(run_dir) == [2]
    # the partial save is gone when the process ends (orbax's threads recreate it after its removal)
    assert not [p for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]
    resumed = cli(*shlex.split(lines[-1].split("continue with: ")[1])[1:])  # the command it printed, as printed
    assert resumed.exit_code == 0, resumed.output
    assert checkpoint_steps(run_dir) == [2, 4, 6]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]  # the partial save is gone


def test_a_stop_in_the_evaluation_a_kill_in_a_save_and_a_corrupted_checkpoint_each_resume_exactly(straight, tmp_path):
    """One run met by three faults in turn, each resumed from, and it ends as the uninterrupted run
    bit for bit, metrics rows included:
    1. SIGTERM as the evaluation after step 3 starts: it stops there (no domain evaluated), saves
       step 3 with its metrics row kept in the checkpoint, and prints the command that resumes;
    2. that command, SIGKILLed in the middle of saving step 4 (after its evaluation of step 3): the
       uncommitted step-4 directory is left behind, the next start removes it, 3 is the latest;
    3. step 3's largest array file truncated (or zeroed, missing, or all of them garbage, in copies):
       its recorded checksums name the file, it is moved aside (kept), step 2 restores, and the
       resume trains on from there."""
    run_dir = tmp_path / "run"
    stopped = _interrupted("eval", "train", *RUN, f"logging.run_dir={run_dir}")
    assert stopped.returncode == 128 + signal.SIGTERM and "Traceback" not in stopped.stderr, stopped.stderr
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("stopped: SIGTERM during the held-out evaluation after step 3 of 6: checkpoint saved "
                           "(step 3; its evaluation runs on resume)"), last
    assert checkpoint_steps(run_dir) == [2, 3] and [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2]
    hint = shlex.split(last.split("continue with: ")[1])
    assert hint[0] == "opd-jax" and "--resume" in hint

    killed = _interrupted("kill", *hint[1:])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert f"resuming {run_dir} from step 3" in killed.stderr, killed.stderr[-2000:]
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name] == ["4.orbax-checkpoint-tmp"]
    assert Checkpoints(run_dir / "checkpoints", keep=3).latest_step() == 3  # and the next start removes it
    assert not [p for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2, 3, 4]  # rows past 3 are redone

    faults = {"truncated": (_truncate, "is 100 bytes"), "zeroed": (_zero, "differs from what was saved (SHA-256)"),
              "missing": (Path.unlink, "is missing"), "garbage": (_garbage_everywhere, "bytes, ")}
    for name in faults:  # copies of the run as the kill left it, for the faults only restored from
        if name != "truncated":
            shutil.copytree(run_dir, tmp_path / name)
    for name, (fault, words) in faults.items():
        corrupted = run_dir if name == "truncated" else tmp_path / name
        arrays = sorted((corrupted / "checkpoints" / "3" / "state").glob("ocdbt.process_0/d/*"),
                        key=lambda f: f.stat().st_size)
        fault(arrays[-1])  # the largest array file
        if name == "truncated":
            result = cli("train", *RUN, f"logging.run_dir={run_dir}", "--resume")
            assert result.exit_code == 0, result.output
            notes = [line for line in result.output.splitlines() if "is unreadable" in line]
            assert "Traceback" not in result.output and "tensorstore" not in result.output.lower()
            assert "from step 2" in result.output
            assert_same_run(straight, run_dir)
        else:
            notes = []
            checkpoints = Checkpoints(corrupted / "checkpoints", keep=3, say=notes.append)
            try:
                step, _, meta = checkpoints.restore_latest(like_state(corrupted))
            finally:
                checkpoints.close()
            assert step == 2 and "groups_drawn" in meta and "tree" not in meta
        assert len(notes) == 1 and notes[0].startswith("checkpoint step 3 is unreadable (state/"), (name, notes)
        assert words in notes[0], (name, notes[0])
        assert (corrupted / "checkpoints_unreadable" / "3" / "state").is_dir()  # kept, not deleted
        assert checkpoint_steps(corrupted)[0] == 2


def test_a_full_disk_is_reported_and_leaves_no_partial_checkpoint(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        result = cli("train", *RUN, f"logging.run_dir={disk / 'run'}")
        one_line_error(result, "no space left on device while saving checkpoint step 2", "the partial checkpoint was "
                       "removed", "there is no complete checkpoint yet", "run the same command again", started=True)
        assert not [p for p in (disk / "run" / "checkpoints").iterdir() if "tmp" in p.name]
        assert json.loads((disk / "run" / "run.json").read_text())["status"] == "failed"
    finally:
        subprocess.run(["umount", str(disk)], check=True)


# -- inputs checked before any work ------------------------------------------------------------

def test_bad_inputs_are_named_before_anything_is_built(tmp_path):
    run_dir = tmp_path / "run"
    binary = tmp_path / "latin1.jsonl"
    binary.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"prompt": "9" * 600,
                                                                                        "answer": "1"}) + "\n")
    cases = [
        (["mesh.data=3"], ["mesh (data=3, fsdp=2, sequence=1, tensor=2) needs 12 devices but 8 are available"]),
        (["model.fresh=null", f"model.path={tmp_path / 'nope'}"], ["model.path:", "does not exist"]),
        (["data.reward_fn=no_such_module:score"], ["data.reward_fn:", "cannot import 'no_such_module'"]),
        ([f"data.train=[{{jsonl: {binary}}}]"], [f"{binary}:2: not UTF-8 text (byte 0xe9 at column 16)"]),
        ([f"data.train=[{{jsonl: {long}}}]"], [f"{long}:2: the prompt is 600 tokens",
                                              "rollout.max_new_tokens 4", "context of 512"]),
        (["rollout.max_new_tokens=100000"], ["rollout.max_new_tokens is 100000", "context of 512"]),
        # a built-in domain's prompts too: its held-out set and a draw of its training stream
        (["rollout.max_new_tokens=490", "data.train=[{builtin: reverse, params: {min_len: 30, max_len: 40}}]"],
         ["data.train[0] (reverse): prompt reverse/", "with rollout.max_new_tokens 490", "context of 512"]),
    ]
    for extra, needles in cases:
        one_line_error(cli("train", *RUN, f"logging.run_dir={run_dir}", *extra), *needles)
        assert not run_dir.exists(), extra


def test_a_bad_reward_names_the_function_and_the_sample_or_is_skipped(tmp_path):
    # checked before the run, on the reference answers: nothing is built, nothing written
    one_line_error(cli("train", *RUN, f"logging.run_dir={tmp_path / 'a'}", "data.reward_fn=bad_reward:raises"),
                   "data.reward_fn, checked on the reference answers before the run: reward function "
                   "bad_reward:raises raised KeyError: 'score_table' on sample max/eval/0 (domain 'max')")
    one_line_error(cli("train", *RUN, f"logging.run_dir={tmp_path / 'a'}", "data.reward_fn=bad_reward:two_arguments"),
                   "data.reward_fn: bad_reward:two_arguments cannot be called as f(prompt, response, answer, domain)")
    one_line_error(cli("train", *RUN, f"logging.run_dir={tmp_path / 'a'}",
                       "algorithm.ppo.advantage=user_algorithms:per_sample_grpo"),
                   "algorithm.ppo.advantage: user_algorithms:per_sample_grpo returned shape (8,) on a batch of 8 "
                   "samples × 6 tokens; an advantage estimator returns one advantage per token, [B, T] = (8, 6)")
    assert not (tmp_path / "a").exists()
    one_line_error(cli("train", *RUN, f"logging.run_dir={tmp_path / 'b'}", "logging.eval_at_start=false",
                       "data.reward_fn=bad_reward:none_on_odd_length"),  # a one-digit answer is odd
                   "reward function bad_reward:none_on_odd_length returned None (NoneType) on sample max/eval/0",
                   "data.on_bad_reward: skip")
    # three new tokens at most: a response cut there has odd length, so some samples are bad
    result = cli("train", *RUN, f"logging.run_dir={tmp_path / 'c'}", "steps=3", "logging.eval_every=3",
                 "rollout.max_new_tokens=3", "data.reward_fn=bad_reward:none_on_odd_length", "data.on_bad_reward=skip")
    assert result.exit_code == 0, result.output
    rows = read_metrics(tmp_path / "c" / "metrics.jsonl")
    steps = [r for r in rows if "reward_mean" in r]
    assert sum(r["reward/bad_samples"] for r in steps) > 0
    assert all(np.isfinite(r["policy/loss"]) for r in steps if r["policy/trained"])
    assert rows[-1]["eval/max/bad_samples"] + 0 >= 0 and np.isfinite(rows[-1]["eval/accuracy"])


def test_a_source_without_held_out_prompts_logs_no_accuracy(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"max {a} {b} {c}:", "answer": str(max(a, b, c))}) + "\n"
                            for a, b, c in [(1, 2, 3), (4, 0, 2), (7, 8, 1), (5, 5, 9)]))
    result = cli("train", *RUN, f"logging.run_dir={tmp_path / 'run'}", f"data.train=[{{jsonl: {data}}}]", "steps=2")
    assert result.exit_code == 0, result.output
    assert not any(k.startswith("eval/") for r in read_metrics(tmp_path / "run" / "metrics.jsonl") for k in r)
    assert "held-out accuracy: none" in result.output


def test_two_ctrl_c_during_one_long_call_count_as_two():
    """Python runs a signal's handler once for any number of that signal arriving while the main
    thread is in one C call (a short checkpoint save): two Ctrl-C there must still stop at once.
    Here the call is a hash of 256 MiB; a thread sends SIGINT twice while it runs."""
    import hashlib
    import threading

    from opd_jax.train import signals

    def twice():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)

    data = b"x" * (256 << 20)
    with signals.stop_at_step_boundary():
        sender = threading.Timer(0.05, twice)
        with pytest.raises(KeyboardInterrupt):
            sender.start()
            for _ in range(20):  # C calls of ~0.3 s each: both signals land inside one of them
                hashlib.sha256(data).digest()
        sender.join()
    with signals.stop_at_step_boundary():  # one Ctrl-C is a request, as before
        os.kill(os.getpid(), signal.SIGINT)
        hashlib.sha256(data[:1 << 20]).digest()
        assert signals.requested() == "SIGINT"


def test_the_continue_hint_is_a_command_that_exists(monkeypatch):
    """train/sft/merge continue with --resume; a recipe (or experts) run continues by running the
    same command again, which takes no --resume."""
    from opd_jax.train.runner import _resume_command

    monkeypatch.setattr(sys, "argv", ["opd-jax", "train", "configs/quickstart.yaml", "steps=9"])
    assert _resume_command() == "opd-jax train --resume configs/quickstart.yaml steps=9"
    monkeypatch.setattr(sys, "argv", ["opd-jax", "recipe", "configs/recipe.yaml", "run_dir=runs/r"])
    assert _resume_command() == "opd-jax recipe configs/recipe.yaml run_dir=runs/r"
