"""Layers point down: every module of the repository sits on one of eight declared layers, and every import goes to
its own layer or a lower one; the losses stand side by side (none imports another); the kernels import only kernels
and the foundation; and the graph has no cycle.

The layers, bottom up: the foundation (runtime, validation, plans, references), the kernels, the core (the chunk
engine, the autograd plumbing, the strategies and their dispatcher), the operators (cross-entropy and log-probs, and
the preference family's formulas of log-probs), the losses, the public API and the integrations, the study, and the
files around the package (scripts, probes, examples, notebooks, run_all.py).

The graph is read with `ast` (imports inside functions count). A node is one module: `fusedkern.x.y` for the
package, a path such as `probes/probe_host.py` for the files around it. An import names the deepest module it
reaches; a name imported from a package's `__init__` that only re-exports it (`from fusedkern import
linear_logprobs`, or `fusedkern.linear_logprobs` after `import fusedkern`) counts as an import of the module the
`__init__` takes it from, so the re-exports do not close cycles; a plain `import fusedkern` used for its side
effect counts as an import of the `__init__`, which imports every loss."""

import ast
from functools import cache
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
#: the files around the package that the graph includes (patterns relative to the repository root)
AROUND = ("scripts/*.py", "probes/*.py", "examples/*.py", "notebooks/*.py", "run_all.py")
#: bottom up: (name, the modules on it: a module, or a package with ".*" for everything under it)
LAYERS = (
    ("foundation", ("fusedkern._runtime", "fusedkern._validation", "fusedkern.chunk_plan", "fusedkern.reference",
                    "fusedkern.sharded")),
    ("kernels", ("fusedkern.kernels", "fusedkern.kernels.*")),
    ("core", ("fusedkern.engine", "fusedkern.autograd", "fusedkern.chunked", "fusedkern.compacted",
              "fusedkern.anchored", "fusedkern.formula", "fusedkern.dispatch")),
    ("operators", ("fusedkern.linear_cross_entropy", "fusedkern.logprobs", "fusedkern.preference",
                   "fusedkern.anticipated")),
    ("losses", ("fusedkern.grpo", "fusedkern.linear_preference", "fusedkern.simpo", "fusedkern.distillation",
                "fusedkern.distributed")),
    ("public API and integrations", ("fusedkern", "fusedkern.integrations", "fusedkern.integrations.*")),
    ("study", ("fusedkern.study", "fusedkern.study.*", "fusedkern.bench")),
    ("around the package", tuple(AROUND)),
)
MAX_LAYERS = 8
KERNELS_MAY_IMPORT = ("fusedkern.kernels", "fusedkern._runtime", "fusedkern.chunk_plan")


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


def _under(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def layer_of(name: str) -> int | None:
    """1-based index of the declared layer holding `name`, or None."""
    for index, (_, members) in enumerate(LAYERS, start=1):
        for member in members:
            if member.endswith(".*") and name.startswith(member[:-1]) or name == member \
                    or "*" in member and Path(name).match(member):
                return index
    return None


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


def test_every_module_sits_on_one_of_8_layers():
    assert len(LAYERS) <= MAX_LAYERS
    unplaced = sorted(name for name in import_graph() if layer_of(name) is None)
    assert not unplaced, f"modules on no declared layer (add each to LAYERS in {Path(__file__).name}): {unplaced}"


def test_imports_point_down():
    names = [name for name, _ in LAYERS]
    upward = sorted((a, b) for a, targets in import_graph().items() for b in targets
                    if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) > layer_of(a))
    assert not upward, "imports running back up: " + ", ".join(
        f"{a} ({names[layer_of(a) - 1]}) → {b} ({names[layer_of(b) - 1]})" for a, b in upward)


def test_losses_stand_side_by_side():
    losses = LAYERS[[name for name, _ in LAYERS].index("losses")][1]
    stacked = sorted((a, b) for a, targets in import_graph().items() if a in losses for b in targets if b in losses)
    assert not stacked, f"a loss built on another loss instead of the operators below: {stacked}"


def test_kernels_import_only_kernels_and_the_foundation():
    outside = sorted((a, b) for a, targets in import_graph().items() if _under(a, ("fusedkern.kernels",))
                     for b in targets if _under(b, ("fusedkern",)) and not _under(b, KERNELS_MAY_IMPORT))
    assert not outside, f"kernels that import fusedkern beyond {KERNELS_MAY_IMPORT}: {outside}"
