"""Layering, checked from the source (ast, nothing imported):

- the two planes stay apart: no module of scheduler_service/ (the CPU control plane) imports
  worker_service/ (the GPU data plane) or the other way round, not even inside a function;
  what both need (TLS, auth, the worker-group contract, shared CLI flags) lives in the
  neutral `nanoserve` package (protos/nanoserve/);
- the project's modules import each other without cycles, counting the imports that run
  when a module is imported (module and class level, not function bodies, not
  `if TYPE_CHECKING:`), and also counting function-local imports: a cycle hidden behind a
  function-local import is still two modules that each need the other.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# package name -> its directory (pyproject.toml maps `nanoserve` to protos/nanoserve)
PACKAGES = {
    "scheduler_service": ROOT / "scheduler_service",
    "worker_service": ROOT / "worker_service",
    "kernels": ROOT / "kernels",
    "models": ROOT / "models",
    "client": ROOT / "client",
    "nanoserve": ROOT / "protos" / "nanoserve",
}
PLANES = ("scheduler_service", "worker_service")


def _generated(path: Path) -> bool:
    return path.stem.endswith(("_pb2", "_pb2_grpc"))


def project_modules() -> dict[str, Path]:
    """Dotted name -> file, for every project module but the generated gRPC stubs."""
    mods = {}
    for pkg, top in PACKAGES.items():
        for path in sorted(top.rglob("*.py")):
            if _generated(path) or "node_modules" in path.parts:
                continue
            parts = [pkg, *path.relative_to(top).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


MODULES = project_modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
           (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST, top_level_only: bool):
    """Import statements under `node`; with top_level_only, those that run at import time."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif top_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda)):
            continue
        elif top_level_only and isinstance(child, ast.If) and _is_type_checking(child.test):
            for sub in child.orelse:
                yield from _import_nodes(ast.Module(body=[sub], type_ignores=[]), top_level_only)
        else:
            yield from _import_nodes(child, top_level_only)


def imported_names(module: str, path: Path, top_level_only: bool) -> list[tuple[str, int]]:
    """(dotted name, line) of everything `module` imports: `from a.b import c` gives a.b.c
    (c may be a module or a name in a.b; resolve() tells)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in _import_nodes(tree, top_level_only):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[:len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        out += [(f"{base}.{a.name}" if a.name != "*" else base, node.lineno) for a in node.names]
        out.append((base, node.lineno))
    return out


def resolve(name: str) -> str | None:
    """The project module a dotted import name lands in (longest known prefix), or None."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in MODULES:
            return candidate
    return None


def import_graph(top_level_only: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for mod, path in MODULES.items():
        for name, _ in imported_names(mod, path, top_level_only):
            target = resolve(name)
            # A package importing its own submodules (or a module its package) is not an edge
            # we judge: `import a.b` runs a/__init__ first by construction.
            if target is not None and target != mod:
                graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _describe(comp: list[str], graph: dict[str, set[str]]) -> str:
    edges = [f"{a} -> {b}" for a in comp for b in sorted(graph[a]) if b in comp]
    return "{" + ", ".join(comp) + "}: " + "; ".join(edges)


def test_modules_found():
    for name in ("scheduler_service.frontend", "worker_service.server", "kernels.attention",
                 "models.qwen3", "client.client", "nanoserve"):
        assert name in MODULES
    assert not any(_generated(p) for p in MODULES.values())


def test_planes_do_not_import_each_other():
    violations = {}
    for mod, path in MODULES.items():
        plane = mod.split(".")[0]
        if plane not in PLANES:
            continue
        other = PLANES[1 - PLANES.index(plane)]
        for name, line in imported_names(mod, path, top_level_only=False):
            if name == other or name.startswith(other + "."):
                where = f"{path.relative_to(ROOT)}:{line}: {mod} imports"
                violations[where] = min(violations.get(where, name), name, key=len)
    assert not violations, ("the planes import each other (move what both need to the "
                            "nanoserve package):\n"
                            + "\n".join(f"{w} {n}" for w, n in sorted(violations.items())))


def test_neutral_package_imports_neither_plane():
    """What both planes share must not pull either plane in."""
    bad = [f"{path.relative_to(ROOT)}:{line}: {mod} imports {name}"
           for mod, path in MODULES.items() if mod.split(".")[0] == "nanoserve"
           for name, line in imported_names(mod, path, top_level_only=False)
           if name.split(".")[0] in PLANES]
    assert not bad, "\n".join(bad)


def test_no_import_cycles_at_import_time():
    graph = import_graph(top_level_only=True)
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(_describe(c, graph) for c in found)


def test_no_import_cycles_behind_function_local_imports():
    graph = import_graph(top_level_only=False)
    found = cycles(graph)
    assert not found, ("import cycles, counting function-local imports (move what both "
                       "modules need into the lower one):\n"
                       + "\n".join(_describe(c, graph) for c in found))


def test_cycle_finder_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
