"""A sweep's results as files: sweep.json (everything), sweep.md (the tables a paper or
BENCHMARKS.md takes), curves.png (the held-out metric per cell, mean with its interval band)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _ci(s: dict[str, float], digits: int = 3) -> str:
    if s["n"] == 0:
        return "–"
    if math.isnan(s["low"]):
        return f"{s['mean']:.{digits}f} (n={s['n']})"
    return f"{s['mean']:.{digits}f} [{s['low']:.{digits}f}, {s['high']:.{digits}f}]"


_OUTCOMES = {"final": "the final {m}", "best": "the best {m} along the run", "gain": "the gain in {m} (final − first)",
             "last_mean": "the mean {m} of the last {last} evaluations", "collapsed": "whether a run collapsed"}
_TESTS = {"paired_t": "paired t-test over seeds", "non_inferiority": "one-sided paired t-test of non-inferiority",
          "fisher_exact": "Fisher's exact test on the collapse counts"}


def primary_markdown(result: dict[str, Any]) -> list[str]:
    """The declared primary outcome, its contrasts and tests, and what they gave."""
    primary = result.get("primary")
    if primary is None:
        return ["No primary outcome was declared (`primary:` in the sweep file): every comparison below is "
                "exploratory.", ""]
    d = primary["declared"]
    outcome = _OUTCOMES[d["outcome"]].format(m=result["eval_metric"], last=d["last"])
    test = _TESTS[d["test"]] + (f" with margin {d['margin']:g} (H0: a − b ≤ −{d['margin']:g})"
                                if d["test"] == "non_inferiority" else f", {d['alternative']}")
    lines = ["## Primary outcome (declared before the runs)", "",
             f"Outcome: {outcome}. Test: {test}; {d['correction']} correction over {len(d['contrasts'])} "
             f"contrast(s), α {d['alpha']:g}.", ""]
    if d["outcome"] == "collapsed":
        lines += ["| a vs b | a collapsed | b collapsed | p | corrected p | below α |",
                  "| --- | ---: | ---: | ---: | ---: | --- |"]
        for r in primary["results"]:
            lines.append(f"| {r['a']} vs {r['b']} | {r['a_count']} | {r['b_count']} | {r['p_value']:.3g} | "
                         f"{r['p_corrected']:.3g} | {'yes' if r['rejects'] else 'no'} |")
    else:
        lines += ["| a − b | pairs | difference | p | corrected p | below α |", "| --- | ---: | ---: | ---: | ---: | --- |"]
        for r in primary["results"]:
            lines.append(f"| {r['a']} − {r['b']} | {r['n']} | {_ci(r)} | {r['p_value']:.3g} | {r['p_corrected']:.3g} | "
                         f"{'yes' if r['rejects'] else 'no'} |")
    return lines + ["", "## Exploratory (everything below was not declared as the primary outcome)", ""]


def _range(s: dict[str, float]) -> str:
    """A wall time: mean (min–max); a t interval of a duration can reach below zero."""
    return "–" if s["n"] == 0 else f"{s['mean']:.0f} ({s['min']:.0f}–{s['max']:.0f})"


def markdown(result: dict[str, Any]) -> str:
    level = f"{result['confidence']:.0%}"
    metric = result["eval_metric"]
    lines = [f"# Sweep over {result['base']}", "",
             f"Seeds {result['seeds']}; mean [{level} Student's t interval] over the seeds that finished.", "",
             *primary_markdown(result),
             f"| cell | runs | first {metric} | final | best | gain (final − first) | collapsed | wall s (min–max) |"
             + "".join(f" {m} |" for m in result["metrics"]),
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + " ---: |" * len(result["metrics"])]
    for name, cell in result["cells"].items():
        s = cell["summary"]
        lines.append(f"| {name} | {s['final']['n']} | {_ci(s['first'])} | {_ci(s['final'])} | {_ci(s['best'])} | "
                     f"{_ci(s['gain'])} | {s['collapse']['any']:.0%} | {_range(s['wall_s'])} |" + "".join(f" {_ci(s[m], 4)} |"
                                                                          for m in result["metrics"]))
    if result["comparisons"]:
        lines += ["", f"Paired differences of the final {metric} (same seeds):", "",
                  "| a − b | pairs | difference | p (paired t) |", "| --- | ---: | ---: | ---: |"]
        for c in result["comparisons"]:
            p = "– (fewer than 2 pairs)" if c["p_value"] != c["p_value"] else f"{c['p_value']:.3g}"
            lines.append(f"| {c['a']} − {c['b']} | {c['n']} | {_ci(c)} | {p} |")
    lines += ["", "Collapse incidence per kind (runs that collapsed / runs):", "",
              "| cell | eval drop | grad blow-up | non-finite | entropy |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, cell in result["cells"].items():
        c = cell["summary"]["collapse"]
        lines.append(f"| {name} | {c['eval_drop']:.0%} | {c['grad_blowup']:.0%} | {c['nonfinite']:.0%} | "
                     f"{c['entropy']:.0%} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, cell in result["cells"].items():
        if not cell["curve"]:
            continue
        steps, mean, low, high = zip(*cell["curve"])
        ax.plot(steps, mean, label=name)
        if not any(math.isnan(x) for x in low):
            ax.fill_between(steps, low, high, alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel(f"held-out {result['eval_metric']}")
    ax.set_title(f"mean and {result['confidence']:.0%} interval over seeds")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out: Path, result: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(result, indent=1, sort_keys=True))
    (out / "sweep.md").write_text(markdown(result))
    plot(result, out / "curves.png")
