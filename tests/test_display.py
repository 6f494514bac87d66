"""What a person watching a run reads: the ETA counts from after the compiling step, the curves
are smoothed as TensorBoard smooths them, the warm start's loss reaches TensorBoard, and the end
summary reports the held-out accuracy the metrics hold."""

import re
import struct

import numpy as np
import pytest
from tensorboardX.proto import event_pb2
from train_loop_settings import TINY

from opd_jax.config import load_config
from opd_jax.train import read_metrics, train
from opd_jax.train.console import progress, restart_clock
from opd_jax.train.metrics import run_summary, smooth


def test_the_eta_ignores_the_compiling_step():
    clock = [0.0]
    bar = progress(10, "train", enabled=True)
    bar._time = lambda: clock[0]  # tqdm reads its clock through this attribute
    bar.start_t = 0.0
    clock[0] = 60.0  # the first step compiles for a minute
    bar.update(1)
    restart_clock(bar)
    clock[0] = 62.0  # then 2 s per step
    bar.update(1)
    meter = bar.format_meter(**bar.format_dict)
    bar.close()
    assert "00:16" in meter  # 8 steps left at 2 s each, not at the 31 s average with the compile


def test_smoothing_is_the_debiased_exponential_average():
    rng = np.random.default_rng(0)
    x = rng.normal(size=50)
    w = 0.9
    reference = [sum(w**i * x[t - i] for i in range(t + 1)) / sum(w**i for i in range(t + 1)) for t in range(50)]
    np.testing.assert_allclose(smooth(list(x), w), reference, rtol=1e-12)
    assert smooth([3.0, 3.0, 3.0], w).tolist() == pytest.approx([3.0, 3.0, 3.0])  # no pull towards 0


def _events(directory):
    """Every scalar (tag, step, value) in a TensorBoard event directory (TFRecord framing)."""
    out = []
    for path in directory.glob("events.out.tfevents.*"):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out


def test_the_warm_start_loss_reaches_tensorboard_and_the_summary_matches_the_metrics(tmp_path):
    run_dir = train(load_config(None, [*TINY, f"logging.run_dir={tmp_path}", "steps=2", "sft.steps=3",
                                       "logging.tensorboard=true", "logging.plot=true", "logging.eval_every=2"]))
    sft = read_metrics(run_dir / "sft_metrics.jsonl")
    logged = {(step, round(value, 5)) for tag, step, value in _events(run_dir / "tensorboard") if tag == "sft/loss"}
    assert logged == {(r["step"], round(r["sft/loss"], 5)) for r in sft}
    assert (run_dir / "curves.png").stat().st_size > 10_000
    rows = read_metrics(run_dir / "metrics.jsonl")
    summary = run_summary(run_dir, {"setup": 1.0, "steps": 65.0})
    first, last = rows[0], rows[-1]
    assert re.search(rf"\n  max +{first['eval/max/accuracy']:.3f} +{last['eval/max/accuracy']:.3f}\n", summary), summary
    assert "wall time: setup 1s, steps 1m05s (total 1m06s)" in summary
    dlogp = np.mean([r["mismatch_abs_logp_diff"] for r in rows if "mismatch_abs_logp_diff" in r])
    assert f"mismatch (mean over 2 steps): |Δlogp| {dlogp:.4f}, outside the band" in summary
    assert "routing flips" not in summary  # a dense policy
    assert "hf_policy/" not in summary and "metrics.jsonl" in summary  # TINY exports no policy
