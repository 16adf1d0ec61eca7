"""docs/vllm.md's first recipe, verbatim, from a plain shell, on vLLM's CPU build.

The recipe's block runs in ``bash`` with a clean environment: ``PATH`` of the system only
(no virtualenv), its own ``HOME`` (so the shadow and the local store are this test's),
``HF_HUB_OFFLINE=1`` (this machine has no model hub). Variables a deployment would set
are added per run, the recipe itself is never edited:

1. a first start (no shadow yet) serves a chat completion; the connector shadows only
   when it closes (``CONTEXTKIT_CONNECTOR_SHADOW_ON_SAVE=false``), so after SIGTERM the
   shadow holds exactly what the stop flushed, and no writer lease or temp file is left;
2. strict mode (``CONTEXTKIT_CONNECTOR_RECOVER_STRICT=1``) over that valid shadow: the
   recovery restores every block the first server stored, vLLM starts, and the same
   request is served from the restored blocks;
3. a misspelled configuration variable stops before vLLM loads: one line, exit status 2.

Run by ``make test-vllm`` (``.venv-vllm``); each server lifetime takes minutes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]

ROOT = Path(__file__).resolve().parents[3]
PORT = 8000  # the recipe's
BASE = f"http://127.0.0.1:{PORT}"
SYSTEM = ("You are Atlas, the SRE assistant of a payments platform. " * 40).strip()


def first_recipe() -> str:
    """The first ``bash`` block of docs/vllm.md's first recipe, as written."""
    text = (ROOT / "docs" / "vllm.md").read_text()
    section = text[text.index("## First recipe"):]
    match = re.search(r"```bash\n(.*?)```", section, re.S)
    assert match, "docs/vllm.md's first recipe has no bash block"
    return match.group(1)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("home")


def _plain_env(home: Path, **extra: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
            "HF_HUB_OFFLINE": "1", **extra}


def _port_free() -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", PORT)) != 0


class Recipe:
    """The recipe running in bash; its server supervisor (``contextkit serve-vllm``)."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        assert _port_free(), f"port {PORT} (the recipe's) is in use; stop what holds it"
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(["bash", "-c", first_recipe()], cwd=ROOT, env=env,
                                         stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text()

    def wait_ready(self) -> None:
        for _ in range(1200):  # polls of /v1/models while the model loads
            if self.proc.poll() is not None:
                raise AssertionError(f"the recipe exited ({self.proc.returncode}):\n"
                                     f"{self.output()[-6000:]}")
            try:
                with urllib.request.urlopen(BASE + "/v1/models", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise AssertionError(f"vLLM never answered:\n{self.output()[-6000:]}")

    def supervisor(self) -> int:
        import psutil

        top = psutil.Process(self.proc.pid)  # bash may exec the last command itself
        for process in [top, *top.children(recursive=True)]:
            if "serve-vllm" in " ".join(process.cmdline()):
                return int(process.pid)
        raise AssertionError("no serve-vllm process under the recipe")

    def stop(self) -> int:
        """SIGTERM to ``contextkit serve-vllm`` (what `docker stop` sends); its status."""
        os.kill(self.supervisor(), signal.SIGTERM)
        return self.proc.wait(timeout=300)

    def kill(self) -> None:
        import psutil

        if self.proc.poll() is None:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                child.kill()
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def recipes() -> Iterator[list[Recipe]]:
    started: list[Recipe] = []
    yield started
    for recipe in started:
        recipe.kill()


def chat() -> dict[str, Any]:
    body = {"model": "smollm2", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "Is checkout slow?"}]}
    request = urllib.request.Request(BASE + "/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=900) as response:
        reply: dict[str, Any] = json.loads(response.read())
    return reply


def _leftovers(shadow: Path) -> list[Path]:
    return [p for p in shadow.rglob("*") if p.name == "writer.lease" or ".tmp-" in p.name]


def _stored_blocks(stats: Path) -> int:
    return sum(json.loads(line)["planned_save_blocks"]
               for line in stats.read_text().splitlines() if line.strip())


def test_the_recipe_serves_after_recovery_strict_and_stops_cleanly(
        home: Path, tmp_path: Path, recipes: list[Recipe]) -> None:
    shadow = home / ".cache" / "contextkit" / "vllm-shadow"  # the recipe's shadow_url
    stats = tmp_path / "stats.jsonl"

    # 1. first start: nothing to restore; the connector's only shadow is the one it
    #    writes when SIGTERM stops vLLM
    cold = Recipe(_plain_env(home, CONTEXTKIT_CONNECTOR_SHADOW_ON_SAVE="false",
                             CONTEXTKIT_CONNECTOR_STATS_PATH=str(stats)), tmp_path / "cold.log")
    recipes.append(cold)
    cold.wait_ready()
    assert "first start: no shadow at" in cold.output()
    reply = chat()
    assert reply["choices"][0]["message"]["content"]
    assert not list(shadow.rglob("manifest.json"))  # nothing shadowed yet
    for _ in range(300):  # the request's stats line, once vLLM closed it
        if stats.is_file() and stats.read_text().strip():
            break
        time.sleep(1)
    stored = _stored_blocks(stats)
    assert stored >= reply["usage"]["prompt_tokens"] // 32 > 0
    assert cold.stop() == 0, cold.output()[-6000:]
    assert "vLLM stopped (SIGTERM)" in cold.output()
    assert "exited without closing its shadow" not in cold.output()
    assert shadow.is_dir() and _leftovers(shadow) == []

    # 2. strict over the valid shadow: every stored block restored, then served from them
    warm = Recipe(_plain_env(home, CONTEXTKIT_CONNECTOR_RECOVER_STRICT="1"),
                  tmp_path / "warm.log")
    recipes.append(warm)
    warm.wait_ready()
    restored = re.search(r"recovered (\d+) session\(s\) for vLLM .*?: (\d+) blocks, "
                         r"(\d+) skipped, (\d+) refused", warm.output())
    assert restored, warm.output()[-6000:]
    assert int(restored.group(2)) == stored and restored.group(3) == restored.group(4) == "0"
    again = chat()
    assert again["usage"]["prompt_tokens"] == reply["usage"]["prompt_tokens"]
    # vLLM's own prefix cache is empty after the restart: these came from the connector
    cached = (again["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert cached >= (reply["usage"]["prompt_tokens"] // 32 - 1) * 32
    assert warm.stop() == 0, warm.output()[-6000:]
    assert _leftovers(shadow) == []


def test_a_bad_configuration_stops_the_recipe_before_vllm_loads(home: Path,
                                                                tmp_path: Path) -> None:
    # a misspelled key of the connector, as a deployment would set it
    proc = subprocess.run(["bash", "-c", first_recipe()], cwd=ROOT, capture_output=True,
                          text=True, timeout=600,
                          env=_plain_env(home, CONTEXTKIT_CONNECTOR_BLOCK_SZE="32"))
    assert proc.returncode == 2, proc.stderr[-4000:]
    # the recipe's first command, scripts/vllm_venv.sh, says the venv is up to date
    lines = [line for line in (proc.stdout + proc.stderr).splitlines()
             if line.strip() and not line.startswith("vllm_venv: ")]
    assert len(lines) == 1, lines[:20]  # no model loading, no crash log
    assert lines[0].startswith("contextkit: error: ")
    assert "$CONTEXTKIT_CONNECTOR_BLOCK_SZE" in lines[0]


def test_the_shipped_example_pins_its_stable_prefix_with_the_default_settings(
        home: Path, tmp_path: Path, recipes: list[Recipe]) -> None:
    """The docs' recipe, untouched settings, the docs' example agent: its stable layers
    are pinned (no "stored unpinned" advice), as the shadow written at the stop shows."""
    server = Recipe(_plain_env(home), tmp_path / "server.log")
    recipes.append(server)
    server.wait_ready()
    agent = subprocess.run([sys.executable, "examples/langchain_vllm.py", "--base-url",
                            BASE + "/v1", "--model", "smollm2", "--turns", "2", "--json"],
                           cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert agent.returncode == 0, agent.stderr[-4000:]
    assert json.loads(agent.stdout.strip().splitlines()[-1])["turns"][1]["cached_tokens"] > 0
    assert server.stop() == 0, server.output()[-6000:]
    assert "stored unpinned" not in server.output(), server.output()[-6000:]
    shadow = home / ".cache" / "contextkit" / "vllm-shadow"
    status = subprocess.run([sys.executable, "-m", "contextkit.cli", "status", "--store",
                             f"file://{shadow}", "--tenant", "acme", "--json"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    sessions = json.loads(status.stdout.strip().splitlines()[-1])["sessions"]
    # the example's stable layers (axioms to capabilities): 63 blocks of 32 tokens
    assert sum(s.get("pinned_blocks") or 0 for s in sessions) >= 60, sessions
