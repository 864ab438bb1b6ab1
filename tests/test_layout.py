"""The layout stays readable: halo_dist's imports run one way (no cycle between modules or between
its subpackages), and no product or benchmark file or function outgrows what a reader takes in at
once (500 and 60 lines).

Imports inside functions count: a cycle that only closes on one code path still ties the two modules
together."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("halo_dist", "launchers", "data_prep")
# the benchmarks produce the reported figures and are read as closely as the product, so they keep
# its sizes too; they are scripts, not a package the product imports, so the import-cycle checks
# keep to halo_dist
SHORT = PRODUCT + ("bench",)
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 60


def _modules() -> dict[str, Path]:
    """``halo_dist.x.y`` -> its file (a package by its ``__init__.py``)."""
    out = {}
    for path in (ROOT / "halo_dist").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the halo_dist modules it imports (``from pkg import name`` points at ``pkg.name``
    when that is a module, else at ``pkg``)."""
    def known(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = (package.split(".")[: len(package.split(".")) - node.level + 1] if node.level
                        else [])
                src = (".".join(base + [node.module] if node.module else base) if node.level
                       else node.module or "")
                targets = [known(f"{src}.{a.name}") if f"{src}.{a.name}" in mods else known(src)
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            else:
                continue
            graph[mod] |= {t for t in targets if t.startswith("halo_dist") and t != mod}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def test_cycle_finder_finds_a_cycle():  # the check below is not vacuous
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules_or_subpackages():
    graph = _import_graph(_modules())
    assert sum(map(len, graph.values())) > 100  # the graph was read
    assert _cycles(graph) == []
    top = lambda m: ".".join(  # noqa: E731  halo_dist.train.trainer -> halo_dist.train
        m.split(".")[:2])
    packages: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        packages.setdefault(top(mod), set()).update(top(t) for t in targets if top(t) != top(mod))
    assert _cycles(packages) == []


def test_product_files_and_functions_stay_short():
    long_files, long_functions = [], []
    for folder in SHORT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            src = path.read_text()
            rel = path.relative_to(ROOT)
            if len(src.splitlines()) > MAX_FILE_LINES:
                long_files.append(f"{rel}: {len(src.splitlines())} lines")
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        long_functions.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    assert not long_files, long_files
    assert not long_functions, long_functions
