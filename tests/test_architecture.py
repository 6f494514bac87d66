"""The arrows of docs/architecture.md that the code must keep: checked on the import statements."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def imports(package: str) -> dict[str, set[str]]:
    """file -> the modules it imports (absolute names)."""
    out = {}
    for path in (ROOT / package).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        out[str(path.relative_to(ROOT))] = names
    return out


def offenders(package: str, bad) -> list[str]:
    return sorted(f"{f}: {m}" for f, mods in imports(package).items() for m in mods if bad(m))


def test_rollout_bridge_imports_nothing_of_opd_jax_but_its_error_root():
    assert not offenders("rollout_bridge", lambda m: m.startswith("opd_jax") and m != "opd_jax.errors")


def test_merge_uses_train_s_public_api_only():
    assert not offenders("opd_jax/merge", lambda m: m.startswith("opd_jax.train."))


def test_the_core_imports_no_shell():
    shell = ("opd_jax.train", "opd_jax.merge", "opd_jax.config", "opd_jax.data", "opd_jax.cli", "rollout_bridge")
    assert not offenders("opd_jax/core", lambda m: m.startswith(shell))


def test_only_parallel_names_mesh_axes():
    axis = re.compile(r"""["'](data|fsdp|tensor)["']\s*[,)\]]""")
    named = []
    for path in list((ROOT / "opd_jax").rglob("*.py")) + list((ROOT / "rollout_bridge").rglob("*.py")):
        if "parallel" in path.parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if axis.search(line) and "mesh" in line.lower():
                named.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not named, named


def test_sweeps_drive_training_only_through_its_command():
    assert not offenders("opd_jax/sweep", lambda m: m.startswith(("opd_jax.train", "opd_jax.core", "opd_jax.models")))


def test_run_files_import_only_the_error_root():
    modules = imports("opd_jax")["opd_jax/run_files.py"]
    assert {m for m in modules if m.startswith(("opd_jax", "jax", "flax", "orbax"))} == {"opd_jax.errors"}, modules
