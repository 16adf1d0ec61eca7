"""Every public name is on an API reference page (docs/api/*.md), and nothing stale is.

Cheap: reads the sources and the pages with ``ast`` and regular expressions, builds
nothing (``make docs`` does, strictly). A name a package exports from ``__all__`` that
no ``::: module`` directive lists fails here, so a new public name cannot be left out
of the reference.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
API_DIR = ROOT / "docs" / "api"

# The public surfaces: packages whose __init__ exports names, and the integration
# modules users import directly (integrations/__init__.py exports nothing itself).
# integrations.vllm.connector is what vLLM loads from --kv-transfer-config.
SURFACES = [
    "contextkit",
    "contextkit.config",
    "contextkit.prompt",
    "contextkit.engine",
    "contextkit.pipeline",
    "contextkit.loop",
    "contextkit.workloads",
    "contextkit.cli",
    "gpu_cache",
    "memory_graph",
    "shadow",
    "integrations.langchain",
    "integrations.llamaindex",
    "integrations.openai",
    "integrations.vllm",
    "integrations.vllm.connector",
]

DIRECTIVE = re.compile(r"^::: *([\w.]+) *\n((?:    .*\n|\n)*)", re.M)
MEMBERS = re.compile(r"^ +members: *(.*)$", re.M)


def _source(module: str) -> Path:
    path = ROOT / module.replace(".", "/")
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _tree(module: str) -> ast.Module:
    return ast.parse(_source(module).read_text())


def _literal_all(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:
                return None  # computed (contextkit: from _EXPORTS)
    return None


def exports(module: str) -> dict[str, str]:
    """Public name -> the module that defines it, read statically.

    Re-exports come from ``from X import name`` and from lazy-export tables
    (``_EXPORTS`` / ``_LAZY``: name -> module); a name defined in ``module`` itself
    maps to ``module``. Dunder names (``__version__``) are not API pages' business.
    """
    tree = _tree(module)
    origin: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                origin[alias.asname or alias.name] = node.module
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and any(
                isinstance(t, ast.Name) and t.id in ("_EXPORTS", "_LAZY") for t in node.targets):
            origin.update(ast.literal_eval(node.value))
    names = _literal_all(tree)
    if names is None:
        names = [name for name, where in origin.items() if where.startswith(module + ".")]
    assert names, f"{module} exports nothing: is its __all__ (or _EXPORTS) readable?"
    return {name: origin.get(name, module) for name in names if not name.startswith("__")}


def _defined(module: str) -> set[str]:
    """Top-level names a module binds (definitions, assignments, imports)."""
    names: set[str] = set()
    for node in _tree(module).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def documented() -> dict[str, set[str]]:
    """Identifier -> the members its directive lists, over every API page.

    ``::: pkg.mod`` with ``members: [A, B]`` documents ``pkg.mod.A`` and ``pkg.mod.B``;
    ``::: pkg.Name`` documents that one object (its members list is empty here).
    """
    found: dict[str, set[str]] = {}
    for page in sorted(API_DIR.glob("*.md")):
        for match in DIRECTIVE.finditer(page.read_text()):
            ident, options = match.group(1), match.group(2)
            members = MEMBERS.search(options)
            listed: set[str] = set()
            if members is not None and members.group(1).strip() != "false":
                value = members.group(1).strip()
                assert value.startswith("[") and value.endswith("]"), (
                    f"{page.name}: write {ident}'s members as one inline list [A, B]")
                listed = {name.strip() for name in value[1:-1].split(",") if name.strip()}
            found.setdefault(ident, set()).update(listed)
    return found


def _on_a_page(package: str, name: str, module: str, pages: dict[str, set[str]]) -> bool:
    return (name in pages.get(module, set())
            or f"{module}.{name}" in pages
            or f"{package}.{name}" in pages)


@pytest.mark.parametrize("package", SURFACES)
def test_every_exported_name_is_on_an_api_page(package: str) -> None:
    pages = documented()
    missing = [f"{module}.{name}" for name, module in sorted(exports(package).items())
               if not _on_a_page(package, name, module, pages)]
    assert not missing, (
        f"not in the API reference: {missing}; add each to the `members:` list of its "
        f"module's `::: module` directive in docs/api/ (or a `::: {package}.Name` block)")


def test_api_pages_list_only_real_names() -> None:
    # mkdocstrings skips a listed member that does not exist without a warning.
    stale = []
    for ident, members in documented().items():
        if _source(ident).exists():
            stale += [f"{ident}.{name}" for name in sorted(members - _defined(ident))]
        else:
            module, _, name = ident.rpartition(".")
            assert _source(module).exists(), f"docs/api: no module for ::: {ident}"
            if name not in _defined(module):
                stale.append(ident)
    assert not stale, f"docs/api lists names that do not exist: {stale}"


def test_every_api_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in sorted(API_DIR.glob("*.md")):
        assert f"api/{page.name}" in nav, f"docs/api/{page.name} is not in mkdocs.yml's nav"


def test_the_grafana_dashboard_queries_only_metrics_that_exist() -> None:
    """Every metric a panel of docs/grafana/contextkit.json queries is exported by
    contextkit.metrics or the vLLM connector (or is vLLM's own)."""
    from prometheus_client import CollectorRegistry

    from contextkit.metrics import ContextkitMetrics
    from integrations.vllm import metrics as connector

    registry = CollectorRegistry()
    ContextkitMetrics(registry=registry)
    suffixes = {"counter": ("_total",), "gauge": ("",),
                "histogram": ("_bucket", "_sum", "_count")}
    known = {f.name + s for f in registry.collect() for s in suffixes[f.type]}
    known |= {connector.METRIC_NAMES[n] + "_total"
              for n in (*connector.COUNTERS, *connector.BY_LAYER)}
    known |= {connector.METRIC_NAMES[n] for n in connector.GAUGES}
    vllm_own = {"vllm:prompt_tokens_total"}
    dashboard = json.loads((ROOT / "docs" / "grafana" / "contextkit.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"(?:vllm:)?[a-z_]*contextkit_[a-z_]+|vllm:[a-z_]+",
                                      target["expr"])}
    assert len(queried) >= 12
    assert queried <= known | vllm_own, sorted(queried - known - vllm_own)
    # And every contextkit metric is on the dashboard somewhere.
    shown = {re.sub(r"_(total|bucket|sum|count)$", "", q) for q in queried}
    assert {re.sub(r"_(total|bucket|sum|count)$", "", k) for k in known} <= shown
