"""docs/shared-tier.md's recipe, its blocks as written, from a plain shell: moto's S3
server, two replicas (``contextkit serve-vllm`` through the wrapper script) sharing the
live tier, vllm-router in front; a turn through the router, the same turn straight to
the other replica, which finds the prompt in the shared tier; the runbook's checks, and
its teardown, after which no lease is left. Run by ``make test-vllm``
(fixed ports: 5000, 5557, 5558, 8000-8002)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]

ROOT = Path(__file__).resolve().parents[3]
PORTS = (5000, 5557, 5558, 8000, 8001, 8002)


def blocks() -> list[str]:
    """The ``bash`` blocks of the recipe section, in order."""
    text = (ROOT / "docs" / "shared-tier.md").read_text()
    section = text[text.index("## Recipe"):]
    section = section[:section.index("\n## ", 5)]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def _free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def _wait(url: str, procs: list[subprocess.Popen[bytes]], seconds: int = 1200) -> None:
    for _ in range(seconds):
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a recipe process exited before {url} answered")
        try:
            _get(url)
            return
        except (urllib.error.URLError, OSError):
            time.sleep(1)
    raise AssertionError(f"{url} never answered")


def _served(port: int) -> float:
    return sum(float(line.rpartition(" ")[2]) for line in _get(
        f"http://127.0.0.1:{port}/metrics").splitlines()
        if line.startswith("vllm:request_success_total"))


@pytest.fixture
def shell(tmp_path: Path) -> Iterator[tuple[dict[str, str], list[subprocess.Popen[bytes]]]]:
    busy = [p for p in PORTS if not _free(p)]
    assert not busy, f"ports {busy} (the recipe's) are in use; stop what holds them"
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "HF_HUB_OFFLINE": "1",
           # the packaged model, converted once for the whole suite
           "CONTEXTKIT_CACHE_DIR": os.environ.get(
               "CONTEXTKIT_CACHE_DIR", str(Path.home() / ".cache" / "contextkit"))}
    procs: list[subprocess.Popen[bytes]] = []
    yield env, procs
    for proc in procs:  # every process of each block's session: moto, vLLM, the router
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
    for proc in procs:
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_the_recipe_serves_a_turn_that_moves_from_the_shared_tier(
        shell: tuple[dict[str, str], list[subprocess.Popen[bytes]]], tmp_path: Path) -> None:
    env, procs = shell
    (settings, s3, replica_a, replica_b, router, turn, served, counters, _kv_aware,
     teardown) = blocks()
    # "every shell shares these settings": run once (one key for every replica)
    shared = subprocess.run(["bash", "-c", settings + "\nenv -0"], cwd=ROOT, env=env,
                            capture_output=True, check=True).stdout
    env = dict(item.split("=", 1) for item in shared.decode().split("\0") if "=" in item)
    assert len(env["CONTEXTKIT_SHADOW_KEY"]) == 64

    def start(script: str, name: str) -> subprocess.Popen[bytes]:
        with (tmp_path / f"{name}.log").open("w") as log:
            proc = subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        return proc

    def run(script: str) -> str:
        done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=900, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    moto = start(s3, "moto")
    assert moto.wait(timeout=120) == 0, (tmp_path / "moto.log").read_text()[-3000:]
    servers = [start(replica_a, "replica-a"), start(replica_b, "replica-b")]
    _wait("http://127.0.0.1:8001/v1/models", servers)
    _wait("http://127.0.0.1:8002/v1/models", servers)
    start(router, "router")
    _wait("http://127.0.0.1:8000/health", servers, 300)

    before = {p: _served(p) for p in (8001, 8002)}
    reply = json.loads(run(turn))
    assert reply["choices"][0]["message"]["content"]
    picked = [p for p in (8001, 8002) if _served(p) > before[p]]
    assert len(picked) == 1, picked
    # the runbook's own way to tell: the replica whose count went up
    counts = dict(line.split(" served ") for line in run(served).splitlines())
    assert {int(p): float(n) for p, n in counts.items()} == {
        p: _served(p) for p in (8001, 8002)}
    other = 8002 if picked == [8001] else 8001

    def read(port: int) -> dict[str, float]:
        text = run(counters)
        assert "# HELP" not in text and "# TYPE" not in text
        return {m.group(1): float(m.group(2)) for m in re.finditer(
            rf"^{port} vllm:contextkit_shared_(\w+)_total\{{[^}}]*\}} ([0-9.e+]+)", text,
            re.M)}

    # the serving replica's uploads land after its turn; its puts show them with no
    # further request (before the ledger, they waited for the replica's next step)
    for _ in range(120):
        if read(picked[0]).get("puts", 0) >= 1:
            break
        time.sleep(0.5)
    assert read(picked[0]).get("puts", 0) >= 1, run(counters)
    moved = json.loads(run(turn.replace("127.0.0.1:8000", f"127.0.0.1:{other}")))
    cached = moved["usage"]["prompt_tokens_details"]["cached_tokens"]
    found = read(other)
    assert found.get("hit_tokens", 0) >= 128 and found.get("gets", 0) >= 1, run(counters)
    assert found.get("refused", 0) == 0
    assert cached >= found["hit_tokens"]

    # teardown, as written: every replica stops cleanly and releases its lease
    assert _leases(env), "the writer should hold a lease while it runs"
    left = run(teardown)
    assert "leases left: []" in left, left
    assert all(server.wait(timeout=60) == 0 for server in servers)


def _leases(env: dict[str, str]) -> list[str]:
    import boto3

    s3 = boto3.client("s3", endpoint_url="http://127.0.0.1:5000",
                      aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                      region_name=env["AWS_DEFAULT_REGION"])
    return [o["Key"] for o in s3.list_objects_v2(Bucket="ck-shared").get("Contents", [])
            if "/leases/" in o["Key"]]
