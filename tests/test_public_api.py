"""The exported names are what they should be, and dependencies point one way."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import gpu_cache

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_cache_exports_are_real_and_complete() -> None:
    for name in gpu_cache.__all__:
        assert getattr(gpu_cache, name) is not None, name
    for required in ("TQ4Codec", "TQGPUCache", "CacheConfig", "CacheIdentity",
                     "BlockMetadataTable", "PrefixPinManager", "Tier", "hash_block_tokens"):
        assert required in gpu_cache.__all__


def _imports(package: str) -> set[str]:
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def test_dependencies_point_one_way() -> None:
    # integrations -> contextkit -> {memory_graph, shadow} -> gpu_cache
    assert not _imports("gpu_cache") & {"contextkit", "memory_graph", "shadow", "integrations"}
    assert not _imports("memory_graph") & {"contextkit", "shadow", "integrations"}
    assert not _imports("shadow") & {"contextkit", "memory_graph", "integrations"}
    assert "integrations" not in _imports("contextkit")


def test_contextkit_exports_resolve() -> None:
    import contextkit

    for name in contextkit.__all__:
        assert getattr(contextkit, name) is not None, name
    for required in ("Engine", "CacheAwareContextPipeline", "cache_aware", "LayerConfig",
                     "MemoryReservations", "MemoryCandidate"):
        assert required in contextkit.__all__


# --------------------------------------------------------------------------- import graph
PACKAGES = ("gpu_cache", "memory_graph", "shadow", "contextkit", "integrations")
#: "package.module:Name" strings (configuration registries) and import_module("...").
_REGISTRY_STRING = re.compile(r"^([a-z_][\w]*(?:\.[a-z_]\w*)*):[A-Za-z_]\w*$")
#: contextkit's rooms, lowest first: a room may import only rooms before it. prompt and
#: engine are siblings (neither imports the other); the faces (``contextkit``'s
#: ``__init__``) point down at everything and are checked apart.
ROOMS = {"config": 0, "metrics": 1, "prompt": 2, "engine": 2, "pipeline": 3, "loop": 4,
         "workloads": 5, "bench": 6, "cli": 7}
#: Tables of lazy faces: resolved on attribute access, always pointing down into the
#: face's own package, so they are not import-time edges.
_FACE_TABLES = {"_EXPORTS", "_LAZY", "_MOVED"}


def _module_names() -> dict[str, Path]:
    names = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names[".".join(parts)] = path
    return names


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _import_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` statement in ``module`` reads from."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[:len(parts) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports.

    Import statements anywhere in the module (functions and ``if TYPE_CHECKING:`` blocks
    included: a type-only loop is still a loop a reader must untangle),
    ``"package.module:Name"`` strings (configuration registries) and
    ``importlib.import_module("...")`` literals. Lazy faces' tables are left out.
    """
    modules = _module_names()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skipped: set[int] = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id in _FACE_TABLES for t in node.targets):
                skipped.update(id(n) for n in ast.walk(node))
        targets: set[str] = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            found: list[str] = []
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _import_base(node, name, is_package)
                found = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                match = _REGISTRY_STRING.match(node.value)
                if match:
                    found = [match.group(1)]
            elif (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module")
                  and node.args and isinstance(node.args[0], ast.Constant)):
                found = [str(node.args[0].value)]
            for target in found:
                resolved = _resolve(target, modules)
                if resolved and resolved != name:
                    targets.add(resolved)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_loop_inside_a_package() -> None:
    loops = _cycles(import_graph())
    assert not loops, f"import loops (TYPE_CHECKING imports and registry strings count): {loops}"


def test_no_import_loop_across_packages() -> None:
    graph = import_graph()
    packages: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for module, targets in graph.items():
        top = module.split(".")[0]
        packages[top].update(t.split(".")[0] for t in targets if t.split(".")[0] != top)
    assert not _cycles(packages), packages
    order = {"gpu_cache": 0, "memory_graph": 1, "shadow": 1, "contextkit": 2, "integrations": 3}
    upward = sorted((a, b) for a, bs in packages.items() for b in bs if order[b] >= order[a])
    assert not upward, f"dependencies must point down (integrations -> contextkit -> ...): {upward}"


def _private_imports(source: str, module: str, is_package: bool,
                     modules: set[str]) -> list[str]:
    """``from x import _name`` statements in ``module`` that take a private name.

    A private module (``from gpu_cache import _storage``) is a module's public face and
    fine; a private name (``from gpu_cache._storage import _run``) is another module's
    inside. Dunder names are not private.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = _import_base(node, module, is_package)
        if _resolve(base, {m: Path() for m in modules}) is None:
            continue  # not one of ours
        for alias in node.names:
            private = alias.name.startswith("_") and not alias.name.startswith("__")
            if private and f"{base}.{alias.name}" not in modules:
                found.append(f"{module}: from {base} import {alias.name}")
    return found


def test_the_private_import_finder_finds_them() -> None:
    modules = {"pkg", "pkg.a", "pkg._b", "pkg.sub", "pkg.sub.c"}
    assert _private_imports("from pkg._b import _run", "pkg.a", False, modules) == [
        "pkg.a: from pkg._b import _run"]
    assert _private_imports("from ..a import _X, Y", "pkg.sub.c", False, modules) == [
        "pkg.sub.c: from pkg.a import _X"]
    assert _private_imports("from .. import _helper", "pkg.sub", True, modules) == [
        "pkg.sub: from pkg import _helper"]
    assert not _private_imports("from pkg import _b\nfrom . import _b", "pkg.a", False, modules)
    assert not _private_imports("from pkg.a import __all__, Public", "pkg.sub.c", False, modules)
    assert not _private_imports("from os import _exit", "pkg.a", False, modules)


def test_no_module_imports_another_modules_private_names() -> None:
    modules = _module_names()
    found = [hit for name, path in sorted(modules.items())
             for hit in _private_imports(path.read_text(), name, path.name == "__init__.py",
                                         set(modules))]
    assert not found, f"make these names public, or move them where they belong: {found}"


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "contextkit" or len(parts) < 2:
        return None
    return parts[1]


def test_contextkit_rooms_point_one_way() -> None:
    """config <- metrics <- {prompt, engine} <- pipeline <- loop <- workloads <- bench <- cli."""
    wrong = []
    for module, targets in import_graph().items():
        room = _room(module)
        if room is None:
            continue
        for target in targets:
            other = _room(target)
            if other is None or other == room:
                continue
            if ROOMS[other] >= ROOMS[room]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, f"a room imports one at or above it: {sorted(wrong)}"


def test_contextkit_top_folder_holds_only_faces_config_and_metrics() -> None:
    top = {p.name for p in (ROOT / "contextkit").iterdir()
           if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())}
    assert top == {"__init__.py", "metrics.py", *ROOMS} - {"metrics"}, sorted(top)
    for room in ROOMS:
        path = ROOT / "contextkit" / room
        if path.is_dir():
            doc = ast.get_docstring(ast.parse((path / "__init__.py").read_text()))
            assert doc and "import" in doc, (
                f"contextkit/{room}/__init__.py: say what the room owns and may import")


def test_old_module_paths_still_import_as_the_new_modules() -> None:
    import importlib

    import contextkit

    for old, new in contextkit._MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    from contextkit.layers import LayerConfig

    from contextkit.prompt import LayerConfig as FromFace

    assert LayerConfig is FromFace
