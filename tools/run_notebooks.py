"""Execute the research notebooks at full size and keep their outputs in the committed copies, so
a reader sees the plots and tables without running anything (the test suite runs them at small
size, `tests/test_notebooks.py`).

    python tools/run_notebooks.py                      # all four, one after another
    python tools/run_notebooks.py ppo_vs_grpo          # one

Run from the repository root; each notebook's runs go to runs/notebooks/NAME/ (and the merge's
to runs/merge_experts, runs/merge, as its configs say). Images are embedded in the notebook.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ("mismatch_analysis", "rl_claims", "ppo_vs_grpo", "opd_merge")


def run(name: str) -> float:
    path = ROOT / "notebooks" / f"{name}.ipynb"
    notebook = nbformat.read(path, as_version=4)
    began = time.perf_counter()
    NotebookClient(notebook, timeout=None, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()
    nbformat.write(notebook, path)
    return time.perf_counter() - began


if __name__ == "__main__":
    for name in sys.argv[1:] or NOTEBOOKS:
        print(f"{name}: {run(name):.0f} s", flush=True)
