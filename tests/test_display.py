"""What a person watching a run reads: the ETA counts from after the compiling step, the curves
are smoothed as TensorBoard smooths them, the warm start's loss reaches TensorBoard, and the end
summary reports the held-out accuracy the metrics hold."""

import json
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


def test_the_eta_ignores_the_compiling_step_and_the_bar_ends_its_line():
    """No frame ever shows the compile's rate as an ETA; the rate counts from after it; and the bar,
    closed after steps faster than its refresh interval, shows its last step and ends its line (so
    what is printed next starts a line of its own)."""
    import io
    out = io.StringIO()
    clock = [0.0]
    bar = progress(10, "train", enabled=True)
    bar.fp = out
    bar.sp = bar.status_printer(out)
    bar._time = lambda: clock[0]  # tqdm reads its clock through this attribute
    bar.start_t = bar.last_print_t = 0.0
    clock[0] = 60.0  # the first step compiles for a minute
    restart_clock(bar, advance=1)
    frames = [f for f in out.getvalue().split("\r") if f.strip()]
    assert "1/10" in frames[-1] and "<?" in frames[-1], frames  # no ETA yet, not the 9 minutes of the compile
    clock[0] = 62.0  # then 2 s per step
    bar.update(1)
    assert "00:16" in bar.format_meter(**bar.format_dict)  # 8 steps left at 2 s each
    for _ in range(8):  # within tqdm's refresh interval: not drawn as they come
        clock[0] += 0.01
        bar.update(1)
    bar.close()
    text = out.getvalue()
    assert text.endswith("\n") and "10/10" in text.split("\r")[-1], text[-200:]


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
    sft = read_metrics(run_dir / "warm_start" / "metrics.jsonl")  # the warm start: a run of its own
    logged = {(step, round(value, 5)) for tag, step, value in _events(run_dir / "warm_start" / "tensorboard")
              if tag == "sft/loss"}
    assert logged == {(r["step"], round(r["sft/loss"], 5)) for r in sft} and len(sft) == 3
    assert json.loads((run_dir / "warm_start" / "run.json").read_text())["status"] == "finished"
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
    assert "LoRA" not in summary
    # the same directory as a LoRA run's (its config says so): the summary names it
    config = (run_dir / "config.yaml").read_text().replace("  lora: null", "  lora: {rank: 4, alpha: 8.0, "
                                                           "targets: [q_proj, v_proj], base_quantization: {kind: int4}}")
    assert "lora: {rank: 4" in config
    (run_dir / "config.yaml").write_text(config)
    assert ("LoRA: rank 4, alpha 8 on q_proj, v_proj; only the adapters trained, on a frozen int4 base"
            in run_summary(run_dir, {"steps": 1.0}))
