"""contextkit works without the frameworks; an integration without its extra says what to do."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter where the frameworks cannot be imported, as if they
# were not installed (a meta path finder that refuses them).
BLOCK = textwrap.dedent("""
    import importlib.abc, sys
    class NotInstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {"langchain", "langchain_core", "langgraph",
                                      "llama_index"}:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, NotInstalled())
""")


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_contextkit_imports_without_the_frameworks() -> None:
    proc = run("""
        import contextkit, integrations
        from contextkit import CacheAwareContextPipeline, cache_aware
        p = CacheAwareContextPipeline()
        assert cache_aware(p)(lambda: "[AXIOMS]\\nx\\n[/AXIOMS]")() == "[AXIOMS]\\nx\\n[/AXIOMS]"
        assert not any(m.split(".")[0] in {"langchain", "langchain_core", "llama_index"}
                       for m in sys.modules)
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


@pytest.mark.parametrize(("module", "extra"), [("integrations.langchain", "langchain"),
                                               ("integrations.llamaindex", "llamaindex")])
def test_integration_without_its_extra_names_the_extra(module: str, extra: str) -> None:
    proc = run(f"""
        from contextkit.config.errors import MissingExtraError
        try:
            import {module}
        except MissingExtraError as exc:
            print(exc)
        else:
            raise SystemExit("imported without the framework")
    """)
    assert proc.returncode == 0, proc.stderr
    assert f"pip install 'contextkit[{extra}]'" in proc.stdout


def test_the_openai_helper_needs_neither_framework_nor_openai() -> None:
    proc = run("""
        import sys
        import integrations.openai
        from integrations.openai import record_usage, request_kwargs
        assert not any(m.split(".")[0] in {"langchain", "langchain_core", "llama_index",
                                            "openai"} for m in sys.modules)
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
