"""The arrows of docs/architecture.md that the code must keep: checked on the import statements."""

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).parents[1]
DOC = ROOT / "docs" / "architecture.md"


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


def test_merge_and_the_census_use_train_s_public_api_only():
    assert not offenders("opd_jax/merge", lambda m: m.startswith("opd_jax.train."))
    assert not offenders("opd_jax/mismatch", lambda m: m.startswith("opd_jax.train."))


def test_the_core_imports_no_shell():
    shell = ("opd_jax.train", "opd_jax.merge", "opd_jax.config", "opd_jax.data", "opd_jax.cli", "rollout_bridge")
    assert not offenders("opd_jax/core", lambda m: m.startswith(shell))


def test_only_parallel_names_mesh_axes():
    from opd_jax.parallel import MESH_AXES
    axis = re.compile(r"""["'](""" + "|".join(MESH_AXES) + r""")["']\s*[,)\]]""")
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


def _package(module: str) -> str | None:
    """The package of the table a module belongs to (opd_jax.<first part>, or rollout_bridge)."""
    parts = module.split(".")
    if parts[0] == "rollout_bridge":
        return "rollout_bridge"
    if parts[0] != "opd_jax" or len(parts) < 2:
        return None
    return ".".join(parts[:2])


def package_arrows() -> dict[str, set[str]]:
    """package -> the other packages its modules import, read off the code."""
    arrows = defaultdict(set)
    for root in ("opd_jax", "rollout_bridge"):
        for file, modules in imports(root).items():
            source = _package(file.removesuffix(".py").replace("/", "."))
            for module in modules:
                target = _package(module)
                if target is not None and target != source:
                    arrows[source].add(target)
    return arrows


def documented_arrows() -> dict[str, set[str]]:
    """package -> the packages its row of the table says it may import."""
    section = DOC.read_text().split("## What each package may import", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            table[cells[0].strip("`")] = set(re.findall(r"`([\w.]+)`", cells[1]))
    return table


def test_every_import_arrow_is_in_the_architecture_table_and_every_row_is_true():
    documented, actual = documented_arrows(), package_arrows()
    packages = {p for p in actual} | {_package(f"opd_jax.{p.stem}") for p in (ROOT / "opd_jax").iterdir()
                                       if p.name != "__init__.py" and not p.name.startswith((".", "_"))
                                       and (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert packages - set(documented) == set(), "packages without a row in docs/architecture.md"
    undocumented = {p: sorted(actual[p] - documented[p]) for p in actual if actual[p] - documented[p]}
    assert not undocumented, f"imports the table does not allow (add them with why, or remove them): {undocumented}"
    stale = {p: sorted(documented[p] - actual.get(p, set())) for p in documented if documented[p] - actual.get(p, set())}
    assert not stale, f"arrows the table lists that the code does not have: {stale}"


def test_k8s_uses_train_and_merge_s_public_api_only():
    assert not offenders("opd_jax/k8s", lambda m: m.startswith(("opd_jax.train.", "opd_jax.merge.")))


def test_the_core_does_no_io():
    io = ("open(", "print(", ".write_text(", ".read_text(", "subprocess", "requests", "httpx")
    found = [f"{p.relative_to(ROOT)}: {word}" for p in (ROOT / "opd_jax" / "core").rglob("*.py")
             for word in io if word in p.read_text()]
    assert not found, found
