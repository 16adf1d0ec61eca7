"""Packaging: the core install alone imports every public face, and every third-party
import in the five packages is declared (core or an extra).

The clean venv sees only the distributions that the core dependencies (and the build
backend) need, linked from this interpreter's environment, and ``pip install --no-index``
installs the project into it: pip itself checks that every core dependency is there, no
network is used, and the CUDA torch a plain ``pip install .`` could fetch is never asked for.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("contextkit", "gpu_cache", "memory_graph", "shadow", "integrations")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
# Imported by the project but installed by the user (vLLM, docs/vllm.md) or in its own
# virtualenv (llama.cpp for `bench decode`, scripts/llamacpp_venv.sh).
NOT_DECLARED = {"vllm", "llama_cpp"}
# Modules that come only with an extra: none may be importable in the core venv.
EXTRA_ONLY = ("tqdm", "matplotlib", "boto3", "botocore", "transformers", "gguf",
              "accelerate", "sentence_transformers", "langchain", "langchain_core",
              "llama_index", "pydantic", "apscheduler", "cryptography", "yaml", "triton")


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _core_closure() -> list[md.Distribution]:
    """The installed distributions the core dependencies and the build backend need."""
    todo = [Requirement(r) for r in
            PYPROJECT["project"]["dependencies"] + PYPROJECT["build-system"]["requires"]]
    seen: dict[str, md.Distribution] = {}
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if _key(req.name) in seen:
            continue
        dist = md.distribution(req.name)
        seen[_key(req.name)] = dist
        todo += [Requirement(r) for r in dist.requires or []]
    return list(seen.values())


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding contextkit installed from a copy of this tree with its core deps only."""
    base = tmp_path_factory.mktemp("core")
    shim = base / "core-deps"
    shim.mkdir()
    for dist in _core_closure():
        assert dist.files is not None, f"{dist.metadata['Name']} has no RECORD"
        for top in {f.parts[0] for f in dist.files if f.parts[0] != ".."}:
            if top == "__pycache__" or top.endswith(".pth") or (shim / top).exists():
                continue
            (shim / top).symlink_to(Path(str(dist.locate_file(top))))
    src = base / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "core-deps.pth").write_text(f"{shim}\n", encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "--no-index", "--no-build-isolation", "--no-cache-dir", "--quiet",
         "--disable-pip-version-check", str(src)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return venv


def _run(venv: Path, code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CONTEXTKIT_CONFIG")}
    return subprocess.run([str(venv / "bin" / "python"), "-c", textwrap.dedent(code)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_core_install_imports_every_public_face(core_venv: Path, tmp_path: Path) -> None:
    proc = _run(core_venv, f"""
        import importlib, importlib.util, sys
        extras = {EXTRA_ONLY!r}
        assert not [m for m in extras if importlib.util.find_spec(m)], "an extra is installed"
        names = 0
        for face in ("contextkit", "gpu_cache", "memory_graph", "shadow", "integrations",
                     "integrations.vllm", "integrations.openai", "contextkit.config"):
            mod = importlib.import_module(face)
            assert "site-packages" in mod.__file__, mod.__file__  # the installed copy
            for name in getattr(mod, "__all__", ()):
                getattr(mod, name)
                names += 1
        print(names)
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.strip()) >= 120  # contextkit, gpu_cache, memory_graph, shadow...
    cli = subprocess.run([str(core_venv / "bin" / "contextkit"), "bench", "--help"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert "ttft" in cli.stdout


def test_core_install_loads_toml_and_names_the_yaml_extra(core_venv: Path,
                                                           tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text('[shadow]\nurl = "file:///var/lib/ck"\n')
    (tmp_path / "c.yaml").write_text("shadow:\n  url: file:///var/lib/ck\n")
    proc = _run(core_venv, """
        from contextkit.config import ConfigError, load_config
        print(load_config("c.toml", env={}).shadow.url)
        try:
            load_config("c.yaml", env={})
        except ConfigError as exc:
            print(exc)
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    url, error = proc.stdout.strip().splitlines()
    assert url == "file:///var/lib/ck"
    assert "pip install 'contextkit[yaml]'" in error


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level module name -> the files that import it, over the five packages."""
    std = set(sys.stdlib_module_names) | set(PACKAGES) | {"__future__"}
    found: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    mods = [node.module]
                else:
                    continue
                for mod in mods:
                    if mod.split(".")[0] not in std:
                        found.setdefault(mod.split(".")[0], set()).add(
                            str(path.relative_to(ROOT)))
    return found


def test_every_third_party_import_is_declared() -> None:
    groups = {"core": PYPROJECT["project"]["dependencies"],
              **PYPROJECT["project"]["optional-dependencies"]}
    declared = {_key(Requirement(r).name) for reqs in groups.values() for r in reqs}
    providers = md.packages_distributions()
    imports = _third_party_imports()
    assert {"torch", "yaml", "boto3", "tqdm"} <= set(imports)  # the scan sees imports
    undeclared = {mod: sorted(files) for mod, files in imports.items()
                  if mod not in NOT_DECLARED
                  and not {_key(d) for d in providers.get(mod, [])} & declared}
    assert not undeclared, f"declare these in pyproject.toml: {undeclared}"


def test_all_extra_holds_every_extra() -> None:
    """`make setup` installs .[all,dev]: the demo and the benches need every extra."""
    extras = PYPROJECT["project"]["optional-dependencies"]

    def included(extra: str) -> set[str]:
        out = {extra}
        for req in map(Requirement, extras[extra]):
            if _key(req.name) == "contextkit":
                for sub in req.extras:
                    out |= included(sub)
        return out

    assert included("all") == set(extras) - {"docs", "dev"}
    assert {"shadow", "ooda"} <= included("vllm")  # extras build on each other
    assert "plot" in included("bench")
