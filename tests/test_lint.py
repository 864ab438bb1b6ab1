"""The repository passes its own ruff configuration (pyproject.toml: undefined and unused names,
statement and syntax errors, lines over 100 columns), so a stale import or a name that only exists
on one code path fails here, not in a GPU job."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes_on_the_repository():
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert "No module named ruff" not in res.stderr, ("ruff is not installed: "
                                                     "pip install -r requirements-ci.txt")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]


def _imported_names(path: Path):
    """``(line, module, name)`` of every ``from halo_dist... import name`` in ``path`` (relative
    imports inside halo_dist resolved), at any depth: imports inside functions run only on their
    code path."""
    import ast

    rel = path.relative_to(ROOT)
    package = list(rel.parts[:-1]) if rel.parts[0] == "halo_dist" else []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            if not package:
                continue
            base = package[: len(package) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        if module == "halo_dist" or module.startswith("halo_dist."):
            for alias in node.names:
                yield node.lineno, module, alias.name


def test_every_halo_dist_import_names_something_that_exists():
    """Every ``from halo_dist.x import y`` in the product, launchers, tests and benchmarks names a
    module or an attribute that exists (ruff cannot see a name that moved to another module)."""
    import importlib

    files = [p for top in ("halo_dist", "launchers", "data_prep", "bench", "tests", "slurm")
             for p in (ROOT / top).rglob("*.py")]
    missing = []
    for path in files:
        for line, module, name in _imported_names(path):
            mod = importlib.import_module(module)
            if name != "*" and not hasattr(mod, name):
                try:
                    importlib.import_module(f"{module}.{name}")
                except ModuleNotFoundError:
                    missing.append(f"{path.relative_to(ROOT)}:{line}: {module} has no {name}")
    assert not missing, "\n".join(missing)
