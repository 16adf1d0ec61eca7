"""The llama.cpp peer of ``contextkit bench decode``: one persistent child process in
its own virtualenv (``.venv-llamacpp``), driven over JSON lines
(:mod:`contextkit.bench._llamacpp_worker`), and the slot that keeps the bench going
when it is missing or dies (its fields null, the reason in one line)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["WORKER", "LlamaCppError", "LlamaCppPeer", "Slot"]

logger = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("_llamacpp_worker.py")
#: Environment variables of the llama.cpp child that change its threading.
_THREAD_ENV = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_PROC_BIND",
               "OMP_PLACES")
_INSTALL = ("llama.cpp is not installed: `make bench-decode` builds .venv-llamacpp (or pass "
            "--llamacpp-python PATH); its fields are null")


class LlamaCppError(RuntimeError):
    """The llama.cpp worker failed, died or could not start (one line)."""


class LlamaCppPeer:
    """The persistent llama.cpp child process (see :mod:`contextkit.bench._llamacpp_worker`).

    Args:
        python: the interpreter of the llama.cpp virtualenv.
        log: where the child's stderr goes.
        timeout_s: longest wait for one reply.
        worker: the worker script (tests may pass another implementing the protocol).

    Raises:
        LlamaCppError: the child could not start or did not say it is ready.
    """

    def __init__(self, python: str | os.PathLike[str], *, log: Path,
                 timeout_s: float = 3600.0, worker: Path = WORKER) -> None:
        self.timeout_s = timeout_s
        self.log = log
        env = dict(os.environ)
        for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
            env.pop(name, None)  # the worker imports nothing of this virtualenv
        #: The child's threading environment as launched (None: unset, the default).
        self.env = {name: env.get(name) for name in _THREAD_ENV}
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = log.open("w")
        try:
            self.proc = subprocess.Popen(
                [str(python), str(worker)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=self._log, text=True, env=env)
        except OSError as exc:
            self._log.close()
            raise LlamaCppError(f"cannot start the llama.cpp worker with {python}: "
                                f"{exc.strerror or exc}") from None
        self.info: dict[str, Any] = {}
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            if not ready:
                self.close()
                raise LlamaCppError(f"the llama.cpp worker did not answer in "
                                    f"{self.timeout_s:g} s; its log: {self.log}")
            rc = self.proc.wait()
            raise LlamaCppError(f"the llama.cpp worker exited (status {rc}): "
                                f"{_last_line(self.log)}; its log: {self.log}")
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            raise LlamaCppError(f"the llama.cpp worker wrote {line.strip()[:200]!r}, not a "
                                f"JSON reply; its log: {self.log}") from None
        if not reply.get("ok"):
            raise LlamaCppError(f"llama.cpp worker: {reply.get('error', reply)}")
        return dict(reply)

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its reply (raises :class:`LlamaCppError`)."""
        if self.proc.poll() is not None:
            raise LlamaCppError(f"the llama.cpp worker is not running (status "
                                f"{self.proc.returncode}); its log: {self.log}")
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            rc = self.proc.wait()
            raise LlamaCppError(f"the llama.cpp worker exited (status {rc}): "
                                f"{_last_line(self.log)}; its log: {self.log}") from None
        return self._read()

    def load(self, model_path: str | os.PathLike[str], *, n_ctx: int, threads: int,
             flash_attn: bool, n_batch: int = 512) -> dict[str, Any]:
        """(Re)load the GGUF with a context of ``n_ctx`` tokens."""
        self.info = self.request("load", model_path=str(model_path), n_ctx=n_ctx,
                                 n_threads=threads, n_batch=n_batch, flash_attn=flash_attn)
        self.info.pop("ok", None)
        return self.info

    def generate(self, ids: Sequence[int], new_tokens: int) -> dict[str, Any]:
        """A cold run: ``prefill_s``, ``decode_s`` and the greedy ``token_ids``."""
        return self.request("generate", ids=list(ids), new_tokens=new_tokens)

    def reuse(self, ids: Sequence[int], then: Sequence[int] = ()) -> dict[str, Any]:
        """Prefix-reuse TTFT of ``ids``; ``then`` evaluated afterwards, untimed."""
        return self.request("reuse", ids=list(ids), then=list(then))

    def close(self) -> None:
        """Stop the child (politely, then by its pid)."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._log.close()


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "nothing on stderr"


def _llamacpp_python(args: argparse.Namespace) -> Path | None:
    if args.llamacpp_python:
        return Path(args.llamacpp_python)
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        candidate = root / ".venv-llamacpp" / "bin" / "python"
        if candidate.exists():
            return candidate
    return None


class Slot:
    """The llama.cpp peer while it lives: a failure closes it, records the one-line
    reason and leaves the contextkit rows running."""

    def __init__(self, args: argparse.Namespace, n_ctx: int, out: Path) -> None:
        self.args = args
        self.peer: LlamaCppPeer | None = None
        self.note: str | None = None
        self.error: str | None = None
        self.info: dict[str, Any] | None = None
        self.env: dict[str, Any] | None = None
        if args.no_llamacpp:
            self.note = "llama.cpp skipped (--no-llamacpp)"
            return
        python = _llamacpp_python(args)
        if python is None or not python.exists():
            self.note = _INSTALL + (f" ({python} does not exist)" if python else "")
            return
        try:
            self.peer = LlamaCppPeer(python, log=out / "llamacpp-worker.log")
        except LlamaCppError as exc:
            self.note = f"{exc}; {_INSTALL}"
            return
        self.env = dict(self.peer.env)
        self.call(self._load, n_ctx)

    def _load(self, peer: LlamaCppPeer, n_ctx: int) -> dict[str, Any]:
        from contextkit.engine import models

        directory, name = models.smollm2_gguf()
        info = peer.load(directory / name, n_ctx=n_ctx, threads=self.args.threads,
                         flash_attn=self.args.llamacpp_flash_attn == "on")
        self.info = {**info, "gguf": name}
        return info

    def ensure_ctx(self, n_ctx: int) -> None:
        """Reload with a larger context when the next requests need it."""
        if self.info is not None and self.info["n_ctx"] < n_ctx:
            self.call(self._load, -(-n_ctx // 1024) * 1024)

    def call(self, fn: Any, *args: Any) -> dict[str, Any] | None:
        """``fn(peer, *args)``; ``None`` when there is no peer or it failed now."""
        if self.peer is None:
            return None
        try:
            return dict(fn(self.peer, *args))
        except LlamaCppError as exc:
            logger.warning("llama.cpp rows stop here: %s", exc)
            self.error = str(exc)
            self.close()
            return None

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
            self.peer = None
