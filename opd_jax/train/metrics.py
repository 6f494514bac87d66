"""Where a run's numbers go: metrics.jsonl (one object per step), TensorBoard event files, a
live progress bar, and at the end a PNG of the curves and a summary for the terminal."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from opd_jax.run_files import WARM_START
from opd_jax.train.console import progress, restart_clock

_BAR_KEYS = {"reward": "reward_mean", "eval": "eval/accuracy", "tok/s": "rollout/tokens_per_s",
             "kl": "policy/approx_kl_k3", "masked": "policy/weight_zero_frac", "|Δlogp|": "mismatch_abs_logp_diff"}


class MetricsLog:
    """Appends to run_dir/metrics.jsonl (kept across resumes), writes TensorBoard scalars, and
    shows a progress bar over the run's steps."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int = 0, *, tensorboard: bool = True,
                 progress_bar: bool = True, description: str = "train"):
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
        self.bar = progress(total_steps, description, initial=start_step, enabled=progress_bar)
        self.last: dict[str, float] = {}
        self.shown: set[str] = set()  # bar fields that were ever non-zero (an always-zero field says nothing)
        self._clock_from_next = False

    def log(self, step: int, metrics: dict[str, Any], *, advance: bool = True) -> None:
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for name, value in row.items():
                if name != "step" and math.isfinite(value):
                    self.writer.add_scalar(name, value, step)
        self.last.update(row)
        self.shown.update(k for k, v in _BAR_KEYS.items() if self.last.get(v))
        self.bar.set_postfix({k: f"{self.last[v]:.3g}" for k, v in _BAR_KEYS.items() if k in self.shown}, refresh=False)
        if advance and self._clock_from_next:  # no frame with the compile's rate: the ETA shows "?" until the next
            restart_clock(self.bar, advance=1)
            self._clock_from_next = False
        elif advance:
            self.bar.update(1)
        else:
            self.bar.refresh()

    def note(self, text: str) -> None:
        """A word on what the bar is waiting for (compiling, ...), until the next step is logged."""
        self.bar.set_postfix_str(text)

    def restart_clock(self) -> None:
        """The ETA ignores the steps so far and the one logged next (the first one, which compiles):
        it counts from that log on."""
        self._clock_from_next = True

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def smooth(values: list[float], weight: float = 0.9) -> np.ndarray:
    """Exponential moving average, debiased (as TensorBoard's smoothing), so the curve starts at
    the first value rather than at 0."""
    out, average = [], 0.0
    for n, v in enumerate(values, start=1):
        average = weight * average + (1 - weight) * v
        out.append(average / (1 - weight**n))
    return np.asarray(out)


def plot_curves(metrics_path: Path, out: Path) -> None:
    """The run's curves as a PNG: training reward (smoothed, the raw values faint behind), held-out
    accuracy per domain on eval steps, and the warm start's loss when the run had one."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    sft_path = metrics_path.parent / WARM_START / "metrics.jsonl"
    sft = [r for r in read_metrics(sft_path) if "sft/loss" in r] if sft_path.exists() else []
    fig, axes = plt.subplots(1, 3 if sft else 2, figsize=(16 if sft else 11, 4))
    if sft:
        steps, loss = [r["step"] for r in sft], [r["sft/loss"] for r in sft]
        axes[0].plot(steps, loss, color="tab:gray", alpha=0.3, linewidth=1)
        axes[0].plot(steps, smooth(loss), color="tab:gray", label="smoothed")
        axes[0].set(title="warm start (SFT) loss", xlabel="SFT step", ylabel="cross-entropy", yscale="log")
    left, right = axes[-2], axes[-1]
    steps = [r["step"] for r in rows if "reward_mean" in r]
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    if rewards:
        left.plot(steps, rewards, color="tab:blue", alpha=0.25, linewidth=1, label="per step")
        left.plot(steps, smooth(rewards), color="tab:blue", linewidth=2, label="smoothed (EMA 0.9)")
        left.legend(fontsize=7)
    left.set(title="training reward", xlabel="step", ylabel="mean reward")
    keys = sorted({k for r in rows for k in r if k.startswith("eval/") and k.endswith("accuracy")})
    for key in keys:
        points = [(r["step"], r[key]) for r in rows if key in r]
        right.plot(*zip(*points), marker="o", label="all domains" if key == "eval/accuracy" else key.split("/")[1],
                   linewidth=2.5 if key == "eval/accuracy" else 1)
    right.set(title="held-out accuracy", xlabel="step", ylabel="accuracy", ylim=(-0.02, 1.02))
    if keys:
        right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _lora(run_dir: Path) -> str | None:
    """'LoRA: ...' when the run trained adapters on a frozen base (its config's model.lora, or a
    merge's student.lora), else None."""
    import yaml

    path = run_dir / "config.yaml"
    config = yaml.safe_load(path.read_text()) if path.exists() else None
    if not isinstance(config, dict):
        return None
    lora = next((section.get("lora") for section in (config.get("model"), config.get("student"))
                 if isinstance(section, dict) and section.get("lora")), None)
    if not isinstance(lora, dict):
        return None
    targets = lora.get("targets", "all-linear")
    base = (lora.get("base_quantization") or {}).get("kind")
    return (f"LoRA: rank {lora.get('rank')}, alpha {lora.get('alpha'):g} on "
            f"{targets if isinstance(targets, str) else ', '.join(targets)}; only the adapters trained, on a frozen "
            f"{base + ' ' if base else ''}base (hf_policy/ is merged, hf_policy/adapter/ the adapters alone)")


def run_summary(run_dir: Path, phases: dict[str, float]) -> str:
    """What a finished run did, for the terminal: held-out accuracy per domain at the first and
    last evaluation, the train/inference mismatch over the steps (and a MoE policy's routing
    flips), wall time per phase, and where the artifacts are."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    evals = [r for r in rows if "eval/accuracy" in r]
    lines = []
    if evals:
        first, last = evals[0], evals[-1]
        keys = ["eval/accuracy"] + sorted(k for k in last if k.startswith("eval/") and k.endswith("/accuracy")
                                          and k.count("/") == 2)
        names = {k: k.split("/")[1] if k.count("/") == 2 else "all domains" for k in keys}
        width = max(len("held-out accuracy"), *(2 + len(n) for n in names.values())) + 2
        lines.append(f"{'held-out accuracy':<{width}}{'step ' + str(first['step']):>10}{'step ' + str(last['step']):>10}")
        for key in keys:
            lines.append(f"{'  ' + names[key]:<{width}}{first.get(key, float('nan')):>10.3f}{last[key]:>10.3f}")
    elif any("sft/loss" in r for r in rows):  # a supervised run: no engine, no held-out evaluation
        losses = [r["sft/loss"] for r in rows if "sft/loss" in r]
        lines.append(f"cross-entropy: {losses[0]:.4g} at step 1, {losses[-1]:.4g} at step {len(losses)} "
                     f"(last 10 steps: {float(np.mean(losses[-10:])):.4g})")
    else:
        lines.append("held-out accuracy: none (no held-out prompts)")
    lora = _lora(run_dir)
    if lora is not None:
        lines.append(lora)
    steps = [r for r in rows if "mismatch_abs_logp_diff" in r]
    engine = _engine(run_dir)
    if engine is not None:
        differs = ", ".join(f"{k.replace('_', ' ')} ({v})" for k, v in engine["differs_in"].items()) or "nothing"
        lines.append(f"engine: {engine['engine']}, log-probs {engine['logprobs']}; differs from the trainer in {differs}")
    if steps:
        # over the steps that logged the key (a policy number is missing on the critic's warm-up steps)
        mean = lambda key: float(np.mean([r[key] for r in steps if key in r] or [0.0]))  # noqa: E731
        # the bypass mode takes θ_old from the engine, so its batch figure is 0 by construction: the
        # update's first forward measures the mismatch there
        bypass = any(r.get("policy/engine_abs_logp_diff", 0) > 0 for r in steps) and \
            mean("mismatch_abs_logp_diff") == 0
        dlogp = mean("policy/engine_abs_logp_diff") if bypass else mean("mismatch_abs_logp_diff")
        line = (f"mismatch (mean over {len(steps)} steps): |Δlogp| {dlogp:.4f}"
                f"{' (π_θ at each update’s first forward against the engine)' if bypass else ''}, "
                f"outside the band {mean('mismatch_outside_band_frac'):.2%}")
        if "policy/moe/flip_frac" in steps[-1]:
            line += f", routing flips {mean('policy/moe/flip_frac'):.2%} of token-layers"
        if "policy/dsa/flip_frac" in steps[-1]:
            line += f", index flips {mean('policy/dsa/flip_frac'):.2%} of token-indexer layers"
        lines.append(line)
    memory = _memory(run_dir)
    if memory is not None:
        critic = f"critic {memory['critic_gib']:.3g} GiB" if memory.get("critic", True) \
            else "no critic (the estimator needs none)"
        if memory.get("reference_gib"):
            critic += f", KL reference {memory['reference_gib']:.3g} GiB"
        lines.append(f"memory: policy {memory['policy_gib']:.3g} GiB, {critic}, optimizer states "
                     f"{memory['optimizer_states_gib']:.3g} GiB; peak resident {memory['peak_rss_gib']:.3g} GiB")
    lines.append("wall time: " + ", ".join(f"{name} {_duration(s)}" for name, s in phases.items())
                 + f" (total {_duration(sum(phases.values()))})")
    files = sorted(p.name + ("/" if p.is_dir() else "") for p in run_dir.iterdir() if not p.name.startswith("."))
    lines.append(f"run directory {run_dir}: {', '.join(files)}")
    return "\n".join(lines)


def _memory(run_dir: Path) -> dict[str, Any] | None:
    """What the run held (memory.json, written by a PPO run's finish), or None."""
    try:
        return json.loads((run_dir / "memory.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _engine(run_dir: Path) -> dict[str, Any] | None:
    """The engine the run's latest attempt sampled with, as run.json records it."""
    try:
        attempts = json.loads((run_dir / "run.json").read_text()).get("attempts", [])
    except (OSError, json.JSONDecodeError):
        return None
    return attempts[-1].get("engine") if attempts else None


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"
