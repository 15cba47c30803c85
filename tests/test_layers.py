"""Layers point down (issue 41 item 4): the import graph of the repository's own Python modules has no cycle, no
library module imports the integrations or the study, the kernels import only kernels and `_runtime`, and the
longest chain of imports, scripts, probes, examples and notebooks included, spans at most 8 layers.

The graph is read with `ast` (imports inside functions count). A node is one module: `fusedkern.x.y` for the
package, a path such as `probes/probe_host.py` for the files around it. An import names the deepest module it
reaches; a name imported from a package's `__init__` that only re-exports it (`from fusedkern import
linear_logprobs`, or `fusedkern.linear_logprobs` after `import fusedkern`) counts as an import of the module the
`__init__` takes it from, so the re-exports do not close cycles; a plain `import fusedkern` used for its side
effect counts as an import of the `__init__`, which imports every loss. A module's layer is 1 + the highest layer
of what it imports (1 for one that imports nothing of the repository)."""

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LAYERS = 8
#: the files around the package that the graph includes (patterns relative to the repository root)
AROUND = ("scripts/*.py", "probes/*.py", "examples/*.py", "notebooks/*.py", "run_all.py")
#: library packages whose modules may import none of `UPPER` (fusedkern/*.py and fusedkern/kernels/*.py)
LIBRARY_PACKAGES = ("fusedkern", "fusedkern.kernels")
UPPER = ("fusedkern.integrations", "fusedkern.study")
KERNELS_MAY_IMPORT = ("fusedkern.kernels", "fusedkern._runtime")

#: What the tree breaks of these rules until issue 41 item 4 is done. A test fails on any break not listed here
#: and xfails (its message names what is left) while only listed ones remain; once one is mended, its entry goes
#: (the test fails until it does), and at 8 layers or fewer `KNOWN_LAYERS` becomes None.
KNOWN_UPWARD = {
    ("fusedkern.bench", "fusedkern.study.bench"),  # `python -m fusedkern.bench`, the study's CLI by a short name
}
KNOWN_KERNEL_IMPORTS = {
    ("fusedkern.kernels.fused_ce", "fusedkern.chunk_plan"),  # fused_accumulator_budget
    ("fusedkern.kernels.gluon_logits_stats", "fusedkern.chunk_plan"),  # LOSS_CHUNK_BUDGET_BYTES
}
KNOWN_LAYERS = 14


def _module_name(path: Path) -> str:
    """fusedkern/kernels/ce_rows.py → fusedkern.kernels.ce_rows; fusedkern/study/__init__.py → fusedkern.study;
    any other file keeps its path relative to the repository root."""
    rel = path.relative_to(ROOT)
    if rel.parts[0] != "fusedkern":
        return rel.as_posix()
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _files() -> dict[str, Path]:
    paths = sorted((ROOT / "fusedkern").rglob("*.py"))
    for pattern in AROUND:
        paths += sorted(ROOT.glob(pattern))
    return {_module_name(p): p for p in paths}


def _is_package(name: str) -> bool:
    path = _files().get(name)
    return path is not None and path.name == "__init__.py"


def _deepest(dotted: str) -> str | None:
    """The deepest module of the repository that `dotted` (a module or a module's attribute) names."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in _files():
            return ".".join(parts[:n])
    return None


@cache
def _reexports(package: str) -> dict[str, str]:
    """What a package's `__init__` takes from where: {public name: module it is imported from}."""
    out = {}
    for node in ast.walk(ast.parse(_files()[package].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                target = _resolve_from(node.module, alias.name)
                if target is not None:
                    out[alias.asname or alias.name] = target
    return out


def _resolve_from(module: str, name: str) -> str | None:
    """`from module import name` → the module of the repository it reaches: the submodule `name` if there is one,
    the module `name` is re-exported from if `module` is a package, else the deepest module in `module`."""
    if f"{module}.{name}" in _files():
        return f"{module}.{name}"
    if _is_package(module) and name in _reexports(module):
        return _reexports(module)[name]
    return _deepest(module)


def _attributes_used(tree: ast.AST, bound: str) -> set[str]:
    """The first attribute of every `bound.attr` in the file (`fusedkern.linear_cross_entropy(...)` → that name)."""
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == bound}


def _imports(name: str) -> set[str]:
    """The modules of the repository that module `name` imports, wherever the import statement stands."""
    path = _files()[name]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if _is_package(name) else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _deepest(alias.name)
                if target is None:  # a sibling file of a script: probes' `import probe_common`
                    sibling = path.parent / f"{alias.name}.py"
                    target = _module_name(sibling) if sibling.exists() else None
                if target is not None and _is_package(target) and alias.asname is None and target == alias.name:
                    used = _attributes_used(tree, target)
                    resolved = {_resolve_from(target, attr) for attr in used} - {None, target}
                    # attributes that reach a module stand for the import; a side-effect import runs the __init__
                    out |= resolved if resolved else {target}
                elif target is not None:
                    out.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if _deepest(module) is None and node.level == 0:
                sibling = path.parent / f"{module}.py"
                if sibling.exists():
                    out.add(_module_name(sibling))
                continue
            for alias in node.names:
                target = _resolve_from(module, alias.name)
                if target is not None:
                    out.add(target)
    out.discard(name)
    return out


@cache
def import_graph() -> dict[str, frozenset[str]]:
    return {name: frozenset(_imports(name)) for name in _files()}


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layers(graph) -> dict[str, tuple[int, tuple[str, ...]]]:
    """{module: (layer, the longest chain from it down)}: 1 + the highest layer of what it imports."""
    memo = {}

    def layer(v):
        if v not in memo:
            below = max((layer(w) for w in sorted(graph[v])), default=(0, ()))
            memo[v] = (below[0] + 1, (v,) + below[1])
        return memo[v]

    for v in graph:
        layer(v)
    return memo


def _library(name: str) -> bool:
    return name in LIBRARY_PACKAGES or name.rpartition(".")[0] in LIBRARY_PACKAGES


def _under(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_the_graph_sees_the_repository():
    graph = import_graph()
    assert {"fusedkern", "fusedkern.engine", "fusedkern.kernels.ce_rows", "fusedkern.integrations.trl",
            "fusedkern.study.bench", "run_all.py"} <= graph.keys()
    assert "fusedkern._runtime" in graph["fusedkern"]  # `from fusedkern import _runtime`: the submodule
    assert "fusedkern.linear_cross_entropy" in graph["fusedkern"]  # a re-export: the module it comes from
    assert any(p.startswith("probes/") for p in graph) and any(p.startswith("notebooks/") for p in graph)
    assert "probes/probe_common.py" in graph["probes/probe_host.py"]  # a sibling file, run as a script


def test_no_cycles():
    cycles = _cycles(import_graph())
    assert not cycles, f"modules that import each other (a cycle): {cycles}"


def _against_known(found: set, known: set, rule: str) -> None:
    """Fails on a break of `rule` not in `known` or on a `known` one that is mended; xfails on known ones alone."""
    new, mended = sorted(found - known), sorted(known - found)
    show = lambda edges: ", ".join(f"{a} → {b}" for a, b in edges)  # noqa: E731
    assert not new, f"{rule}: {show(new)}"
    assert not mended, f"mended, so drop from this file's KNOWN list: {show(mended)}"
    if found:
        pytest.xfail(f"{rule} (known, issue 41 item 4): {show(sorted(found))}")


def test_library_imports_no_integration_and_no_study():
    upward = {(a, b) for a, targets in import_graph().items() if _library(a) for b in targets if _under(b, UPPER)}
    _against_known(upward, KNOWN_UPWARD, "library modules (fusedkern/*, fusedkern/kernels/*) that import an "
                                         "integration or the study (an import running back up)")


def test_kernels_import_only_kernels_and_runtime():
    outside = {(a, b) for a, targets in import_graph().items() if _under(a, ("fusedkern.kernels",))
               for b in targets if _under(b, ("fusedkern",)) and not _under(b, KERNELS_MAY_IMPORT)}
    _against_known(outside, KNOWN_KERNEL_IMPORTS,
                   "kernels that import fusedkern beyond fusedkern.kernels and fusedkern._runtime")


def test_at_most_8_layers():
    graph = import_graph()
    assert not _cycles(graph), "a cycle: see test_no_cycles"
    depth = layers(graph)
    count, chain = max(depth.values())
    message = f"{count} layers (at most {MAX_LAYERS}); the longest chain: " + " → ".join(chain)
    if count <= MAX_LAYERS:
        assert KNOWN_LAYERS is None, f"{message}: set KNOWN_LAYERS = None"
        return
    assert KNOWN_LAYERS is not None and count <= KNOWN_LAYERS, f"{message}; {KNOWN_LAYERS} known"
    pytest.xfail(f"{message} (known, issue 41 item 4)")
