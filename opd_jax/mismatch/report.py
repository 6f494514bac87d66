"""The census's report: each figure as a mean with its 95% Student's t interval over seeds
(mismatch.json holds those and every seed's own), mismatch.md (the engines side by side, then per
engine by decile of trainer probability and by response position) and mismatch.png."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from opd_jax.mismatch.figures import band_name  # noqa: E402
from opd_jax.sweep.stats import interval  # noqa: E402


def _pooled(per_seed: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    keys = [k for k in per_seed[0] if all(k in s for s in per_seed)]
    return {k: interval([s[k] for s in per_seed]) for k in keys}


def aggregate(result: dict[str, Any]) -> dict[str, Any]:
    """Each engine's figures over its seeds: {"tokens", "sequences", "speed": {figure: interval},
    "by_probability", "by_position": [bin: {figure: interval}]}."""
    for entry in result["engines"].values():
        seeds = list(entry["seeds"].values())
        summary = {part: _pooled([s[part] for s in seeds]) for part in ("tokens", "sequences", "speed")}
        for part in ("by_probability", "by_position"):
            bins = min(len(s[part]) for s in seeds)
            summary[part] = [_pooled([s[part][b] for s in seeds]) for b in range(bins)]
        if all("index" in s for s in seeds):  # a DSA model's index flips and its two scorings
            index = [s["index"] for s in seeds]
            summary["index"] = {"flip_frac": interval([i["flip_frac"] for i in index]),
                                "flip_frac per layer": [interval([i["flip_frac per layer"][layer] for i in index])
                                                        for layer in range(len(index[0]["flip_frac per layer"]))],
                                **{part: [_pooled([i[part][b] for i in index]) for b in range(min(len(i[part])
                                                                                                 for i in index))]
                                   for part in ("by_probability", "by_position")},
                                **{part: _pooled([i[part] for i in index]) for part in ("own keys", "engine's keys")}}
        entry["summary"] = summary
    return result


def _cell(x: dict[str, float] | None, fmt: str) -> str:
    if x is None:
        return "—"
    if x["n"] < 2 or x["low"] != x["low"]:
        return f"{x['mean']:{fmt}}"
    return f"{x['mean']:{fmt}} [{x['low']:{fmt}}, {x['high']:{fmt}}]"


def markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    bands = [band_name(*b) for b in s["bands"]]
    lines = [
        "# Engine mismatch census", "",
        f"{s['samples']} responses per engine and seed (up to {s['max_new_tokens']} tokens, T = {s['temperature']:g}), "
        f"seeds {s['seeds']}; trainer {s['trainer_dtype']}. Each figure: mean [95% Student's t interval] over the "
        f"seeds. Ratio k = π_trainer / π_engine per sampled token; phantom clip: outside PPO's clip band "
        f"[{s['clip'][0]:g}, {s['clip'][1]:g}] at step 0 were the ratio taken against the engine.", "",
        "| engine | what it is | tokens | mean abs(Δlogp) | k3 KL | " + " | ".join(bands)
        + " | phantom clip | ratio q01 / q99 | drift of Σ log k per 1k tokens | low-p / high-p decile abs(Δlogp) |",
        "| --- | --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in bands) + " | ---: | ---: | ---: | ---: |"]
    for name, e in result["engines"].items():
        t, q = e["summary"]["tokens"], e["summary"]["sequences"]
        deciles = e["summary"]["by_probability"]
        ratio = deciles[0]["abs_dlogp"]["mean"] / max(deciles[-1]["abs_dlogp"]["mean"], 1e-12) if deciles else float("nan")
        lines.append(f"| {name} | {e['kind']} | {t['tokens']['mean']:.0f} | {_cell(t.get('abs_dlogp'), '.4f')} | "
                     f"{_cell(t.get('kl_k3'), '.1e')} | "
                     + " | ".join(_cell(t.get(b), '.2%') for b in bands)
                     + f" | {_cell(t.get('phantom clip'), '.2%')} | {t['ratio q01']['mean']:.3f} / "
                     f"{t['ratio q99']['mean']:.3f} | {_cell(q.get('drift per 1k tokens'), '.3f')} | {ratio:.1f}× |")
    for name, e in result["engines"].items():
        lines += ["", f"## {name}: by decile of the trainer's probability (lowest first)", "",
                  "| p range | mean abs(Δlogp) | k3 KL | outside [0.5, 2] | phantom clip |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for b in e["summary"]["by_probability"]:
            lines.append(f"| {b['p_low']['mean']:.2g}–{b['p_high']['mean']:.2g} | {_cell(b.get('abs_dlogp'), '.4f')} | "
                         f"{_cell(b.get('kl_k3'), '.1e')} | {_cell(b.get(band_name(0.5, 2)), '.2%')} | "
                         f"{_cell(b.get('phantom clip'), '.2%')} |")
        lines += ["", f"## {name}: by position in the response", "",
                  "| positions | tokens | mean abs(Δlogp) | k3 KL | phantom clip |", "| --- | ---: | ---: | ---: | ---: |"]
        for b in e["summary"]["by_position"]:
            lines.append(f"| {b['from']['mean']:.0f}–{b['to']['mean']:.0f} | {b['tokens']['mean']:.0f} | "
                         f"{_cell(b.get('abs_dlogp'), '.4f')} | {_cell(b.get('kl_k3'), '.1e')} | "
                         f"{_cell(b.get('phantom clip'), '.2%')} |")
    lines += _index_markdown(result)
    return "\n".join(lines) + "\n"


def _index_markdown(result: dict[str, Any]) -> list[str]:
    """A DSA model's section: index flips, and the mismatch without and with index replay."""
    indexed = {name: e["summary"]["index"] for name, e in result["engines"].items() if "index" in e["summary"]}
    if not indexed:
        return []
    lines = ["", "## DSA: the indexers' choices", "",
             "Index flips: the share of (response token, indexer layer) pairs whose top-k key set differs between "
             "engine and trainer. The mismatch twice: the trainer attending its own keys, and the engine's (index "
             "replay).", "",
             "| engine | index flips | per indexer layer | keys | mean abs(Δlogp) | k3 KL | phantom clip |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: |"]
    for name, x in indexed.items():
        layers = ", ".join(f"{f['mean']:.1%}" for f in x["flip_frac per layer"])
        head = f"| {name} | {_cell(x['flip_frac'], '.2%')} | {layers} |"
        for keys, label in (("own keys", "the trainer's own"), ("engine's keys", "the engine's (replay)")):
            t = x[keys]
            lines.append(f"{head} {label} | {_cell(t.get('abs_dlogp'), '.4f')} | {_cell(t.get('kl_k3'), '.1e')} | "
                         f"{_cell(t.get('phantom clip'), '.2%')} |")
            head = "| | | |"
    for name, x in indexed.items():
        lines += ["", f"### {name}: index flips by decile of the trainer's probability and by position", "",
                  "| p range | index flips | | positions | index flips |", "| --- | ---: | --- | --- | ---: |"]
        deciles, bins = x["by_probability"], x["by_position"]
        for i in range(max(len(deciles), len(bins))):
            d = deciles[i] if i < len(deciles) else None
            b = bins[i] if i < len(bins) else None
            left = f"{d['p_low']['mean']:.2g}–{d['p_high']['mean']:.2g} | {_cell(d['flip_frac'], '.2%')}" if d else " | "
            right = f"{b['from']['mean']:.0f}–{b['to']['mean']:.0f} | {_cell(b.get('flip_frac'), '.2%')}" if b else " | "
            lines.append(f"| {left} | | {right} |")
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, e in result["engines"].items():
        deciles = e["summary"]["by_probability"]
        a.plot(range(1, len(deciles) + 1), [d["abs_dlogp"]["mean"] for d in deciles], marker="o", label=name)
        bins = [p for p in e["summary"]["by_position"] if "abs_dlogp" in p]
        b.plot([(p["from"]["mean"] + p["to"]["mean"]) / 2 for p in bins], [p["abs_dlogp"]["mean"] for p in bins],
               marker="o", label=name)
    a.set(xlabel="decile of the trainer's probability (1: lowest)", ylabel="mean |Δlogp|")
    b.set(xlabel="position in the response", ylabel="mean |Δlogp|")
    for ax in (a, b):
        ax.set_yscale("log", nonpositive="mask")
    a.legend()
    fig.suptitle("engine vs trainer, mean over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_report(out: Path, result: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # strict JSON (jq, JSON.parse): a figure without a value (one seed's interval) is null, not NaN
    (out / "mismatch.json").write_text(json.dumps(_finite(result), indent=1, allow_nan=False))
    (out / "mismatch.md").write_text(markdown(result))
    plot(result, out / "mismatch.png")
