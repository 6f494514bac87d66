"""Where a run's numbers go: metrics.jsonl (one object per step), TensorBoard event files, a
live progress bar, and at the end a PNG of the reward and eval curves."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import tqdm

_BAR_KEYS = {"reward": "reward_mean", "eval": "eval/accuracy", "tok/s": "rollout/tokens_per_s",
             "kl": "policy/approx_kl_k3", "masked": "policy/weight_zero_frac", "|Δlogp|": "mismatch_abs_logp_diff"}


class MetricsLog:
    """Appends to run_dir/metrics.jsonl (kept across resumes), writes TensorBoard scalars, and
    shows a progress bar over the run's steps."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int = 0, *, tensorboard: bool = True,
                 progress_bar: bool = True):
        self.path = run_dir / "metrics.jsonl"
        if start_step == 0:
            self.path.write_text("")
        else:  # resuming: drop what the killed run logged after its last checkpoint
            kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= start_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.writer = None
        if tensorboard:
            from tensorboardX import SummaryWriter
            self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.bar = tqdm.tqdm(total=total_steps, initial=start_step, disable=not progress_bar, unit="step",
                             dynamic_ncols=True)
        self.last: dict[str, float] = {}

    def log(self, step: int, metrics: dict[str, Any], *, advance: bool = True) -> None:
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for name, value in row.items():
                if name != "step" and math.isfinite(value):
                    self.writer.add_scalar(name, value, step)
        self.last.update(row)
        self.bar.set_postfix({k: f"{self.last[v]:.3g}" for k, v in _BAR_KEYS.items() if v in self.last})
        if advance:
            self.bar.update(1)
        else:
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_curves(metrics_path: Path, out: Path) -> None:
    """reward_mean per step and eval accuracy (overall and per domain) on eval steps, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in rows if "reward_mean" in r]
    left.plot(steps, [r["reward_mean"] for r in rows if "reward_mean" in r])
    left.set(title="training reward", xlabel="step", ylabel="mean reward")
    keys = sorted({k for r in rows for k in r if k.startswith("eval/") and k.endswith("accuracy")})
    for key in keys:
        points = [(r["step"], r[key]) for r in rows if key in r]
        right.plot(*zip(*points), marker="o", label=key.removeprefix("eval/").removesuffix("/accuracy") or "all",
                   linewidth=2.5 if key == "eval/accuracy" else 1)
    right.set(title="held-out accuracy", xlabel="step", ylabel="accuracy", ylim=(-0.02, 1.02))
    if keys:
        right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
