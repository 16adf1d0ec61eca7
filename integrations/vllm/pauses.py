"""Tool-call pauses: an agent session's KV kept by the connector while it waits.

An agent whose reply is a tool call comes back when the tool returns, seconds to a
minute later, with the same prompt plus the tool's result. In between, other agents'
saves would evict its blocks from the connector's DDR tier. The scheduler learns each
session's pause (from a request's end to the session's next request) and, when a
session's request ends, asks the worker to keep that request's blocks for the pause
it expects (:class:`KeepSpec`): ``margin`` times the longest of the session's recent
pauses, at most :data:`~integrations.vllm.hints.MAX_KEEP_S`. They are pinned on the
device tier as far as the tenant's quota allows, the rest moved there unpinned. Ahead
of its expected return (:attr:`SessionPauses.warm_at` of its shortest recent pause) a
look-ahead brings back to the device tier what others' traffic spilled meanwhile
(:meth:`SessionPauses.due`). When the session comes back, after its loads, the pins
are released. A session is named by the request's hints (the ``x-session-id`` /
``x-dynamo-session-id`` headers or ``retention_scope``); requests without one are not
kept. The pins count against the tenant's pin quota like any other.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from integrations.vllm.hints import MAX_KEEP_S

__all__ = ["KeepSpec", "SessionPauses"]


@dataclass(slots=True)
class KeepSpec:
    """Worker instruction: pin the stored blocks ``keys`` (a prefix chain, in order)
    of ``tenant`` for ``keep_s`` seconds, as many as the quota allows from the first;
    ``keep_s`` 0 releases the pins an earlier keep of these keys made; ``warm`` moves
    them back to the device tier instead (the session is due)."""

    tenant: str
    keys: list[bytes]
    keep_s: float
    session: str = ""
    #: a look-ahead, not a keep: bring the held blocks back to the device tier
    warm: bool = False


@dataclass
class _Session:
    tenant: str
    finished_at: float | None = None
    keys: list[bytes] = field(default_factory=list)
    kept: bool = False
    pauses: deque[float] = field(default_factory=lambda: deque(maxlen=8))


class SessionPauses:
    """Per (tenant, session): when its last request ended, which blocks it held, and
    its recent pauses. Bounded: the least recently seen sessions are forgotten."""

    def __init__(self, *, margin: float = 1.5, warm_at: float = 0.75,
                 max_sessions: int = 4096) -> None:
        self.margin = margin
        #: the look-ahead runs this share of the session's shortest recent pause in
        self.warm_at = warm_at
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[tuple[str, str], _Session] = OrderedDict()
        self._due: dict[tuple[str, str], float] = {}  # kept sessions -> when to warm

    def _session(self, tenant: str, session: str) -> _Session:
        key = (tenant, session)
        found = self._sessions.get(key)
        if found is None:
            found = self._sessions[key] = _Session(tenant)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(key)
        return found

    def expected(self, tenant: str, session: str) -> float | None:
        """The pause this session's next request is expected after (seconds), from its
        history; None before its first pause."""
        found = self._sessions.get((tenant, session))
        if found is None or not found.pauses:
            return None
        return min(MAX_KEEP_S, self.margin * max(found.pauses))

    def arrived(self, tenant: str, session: str, now: float | None = None
                ) -> KeepSpec | None:
        """A request of the session arrived: its pause is learned, and the blocks kept
        for it are to be released (once this request has loaded them)."""
        now = time.monotonic() if now is None else now
        found = self._session(tenant, session)
        release = None
        self._due.pop((tenant, session), None)
        if found.finished_at is not None:
            found.pauses.append(max(0.0, now - found.finished_at))
            if found.kept:
                release = KeepSpec(tenant, found.keys, 0.0, session)
            found.finished_at, found.keys, found.kept = None, [], False
        return release

    def finished(self, tenant: str, session: str, keys: list[bytes],
                 now: float | None = None) -> KeepSpec | None:
        """A request of the session ended holding blocks ``keys``: keep them for the
        expected pause, if the session has a history."""
        now = time.monotonic() if now is None else now
        found = self._session(tenant, session)
        found.finished_at, found.keys = now, list(keys)
        keep = self.expected(tenant, session)
        found.kept = bool(keep and keys)
        if not found.kept or keep is None:
            return None
        self._due[(tenant, session)] = now + self.warm_at * min(found.pauses)
        return KeepSpec(tenant, list(keys), keep, session)

    def due(self, now: float | None = None) -> list[KeepSpec]:
        """The look-ahead: kept sessions whose return is near, each once per pause, as
        warm instructions for their blocks."""
        now = time.monotonic() if now is None else now
        ready = [key for key, at in self._due.items() if at <= now]
        specs = []
        for key in ready:
            del self._due[key]
            found = self._sessions.get(key)
            if found is not None and found.kept:
                specs.append(KeepSpec(key[0], list(found.keys), 0.0, key[1], warm=True))
        return specs
