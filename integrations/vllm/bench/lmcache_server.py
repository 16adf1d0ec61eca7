"""LMCache's multi-process server for ``bench agents-vllm``'s ``lmcache`` configuration.

On vLLM's CPU build LMCache's in-process connector (``LMCacheConnectorV1``) has no CPU
path and silently recomputes; its multi-process mode runs: ``lmcache server`` (L1 in
RAM, ``engine_driven`` transfer over shared memory) and vLLM's ``LMCacheMPConnector``.
Usage reporting is turned off before the first LMCache process starts
(``LMCACHE_TRACK_USAGE=false``, ``DO_NOT_TRACK=1``): nothing but 127.0.0.1 is
contacted. The chunk size must be a multiple of vLLM's block size (32 on this build).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from integrations.vllm.bench.harness import free_port

__all__ = ["LMCacheServer"]

#: LMCache's environment, for the server and for vLLM (its connector imports lmcache).
QUIET = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}


class LMCacheServer:
    """An ``lmcache server`` process with an L1 of ``budget_bytes`` in RAM.

    Args:
        work: where its log goes.
        chunk_tokens: LMCache's chunk size (a multiple of vLLM's block size).
        budget_bytes: the L1 size (LMCache stores vLLM's KV as is: float32 here).
    """

    def __init__(self, work: Path, *, chunk_tokens: int, budget_bytes: int) -> None:
        self.work, self.chunk_tokens, self.budget_bytes = work, chunk_tokens, budget_bytes
        self.port, self.http_port = free_port(), free_port()
        self.shm = f"ck_lmc_{os.getpid()}"
        self.log_path = work / "lmcache-server.log"
        exe = shutil.which("lmcache", path=str(Path(sys.executable).parent)) or "lmcache"
        self.cmd = [exe, "server", "--host", "127.0.0.1", "--port", str(self.port),
                    "--chunk-size", str(chunk_tokens),
                    "--l1-size-gb", f"{budget_bytes / 2**30:.6f}",
                    "--supported-transfer-mode", "engine_driven", "--eviction-policy", "LRU",
                    "--max-workers", "1", "--http-host", "127.0.0.1",
                    "--http-port", str(self.http_port), "--shm-name", self.shm]
        self._proc: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        return dict(QUIET)

    def kv_transfer_config(self) -> dict[str, Any]:
        return {"kv_connector": "LMCacheMPConnector",
                "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                              "lmcache.mp.port": self.port,
                                              "lmcache.mp.mp_transfer_mode": "engine_driven"}}

    def start(self, timeout: float = 180.0) -> LMCacheServer:
        """Start the server and wait until its port accepts connections.

        Raises:
            SystemExit: lmcache is not installed, or the server exited or did not start.
        """
        if not Path(self.cmd[0]).is_file() and shutil.which(self.cmd[0]) is None:
            raise SystemExit("lmcache is not installed in this environment: "
                             "scripts/vllm_venv.sh installs it into .venv-vllm")
        env = {**os.environ, **QUIET}
        with self.log_path.open("w") as log:
            self._proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                          env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise SystemExit(f"lmcache server exited ({self._proc.returncode}); see "
                                 f"{self.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                    return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise SystemExit(f"lmcache server did not start in {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def describe(self) -> dict[str, Any]:
        import importlib.metadata

        try:
            version = importlib.metadata.version("lmcache")
        except importlib.metadata.PackageNotFoundError:
            version = None
        return {"version": version, "mode": "LMCacheMPConnector + lmcache server "
                "(engine_driven, SHM, L1 in RAM, LRU)", "chunk_tokens": self.chunk_tokens,
                "l1_bytes": self.budget_bytes, "stores": "vLLM's KV as is (float32)"}
