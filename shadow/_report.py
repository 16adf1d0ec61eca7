"""What a recovery did: :class:`RecoveryReport` and :class:`SkippedBlock`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RecoveryReport", "SkippedBlock"]


@dataclass(frozen=True, slots=True)
class SkippedBlock:
    """A block recovery left out, and why."""

    session_id: str
    index: int  # position in the manifest
    key: str | None
    reason: str


@dataclass(slots=True)
class RecoveryReport:
    """What a recovery did.

    ``block_ids`` maps each recovered session to the cache ids of its blocks in
    manifest order (``None`` where a block was skipped). ``rollbacks`` names the
    sessions recovered from a manifest older than the newest generation the store
    records for them (accepted by the caller), with why. ``chunks`` counts the chunk
    index entries put back, ``chunks_dropped`` those left out because a block of theirs
    was not recovered, and ``chunks_refused`` says why each unreadable entry was refused.
    """

    sessions: list[str] = field(default_factory=list)
    blocks: int = 0
    bytes: int = 0
    skipped: list[SkippedBlock] = field(default_factory=list)
    seconds: float = 0.0
    already_present: int = 0
    pinned: int = 0
    errors: dict[str, str] = field(default_factory=dict)
    block_ids: dict[str, list[int | None]] = field(default_factory=dict)
    rollbacks: dict[str, str] = field(default_factory=dict)
    chunks: int = 0
    chunks_dropped: int = 0
    chunks_refused: list[str] = field(default_factory=list)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def merge(self, other: RecoveryReport) -> None:
        self.sessions += other.sessions
        self.blocks += other.blocks
        self.bytes += other.bytes
        self.skipped += other.skipped
        self.seconds += other.seconds
        self.already_present += other.already_present
        self.pinned += other.pinned
        self.errors.update(other.errors)
        self.block_ids.update(other.block_ids)
        self.rollbacks.update(other.rollbacks)
        self.chunks += other.chunks
        self.chunks_dropped += other.chunks_dropped
        self.chunks_refused += other.chunks_refused

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (counts, plus the reasons of skips and errors)."""
        return {
            "sessions": len(self.sessions),
            "session_ids": list(self.sessions),
            "blocks": self.blocks,
            "bytes": self.bytes,
            "skipped": self.num_skipped,
            "seconds": round(self.seconds, 6),
            "already_present": self.already_present,
            "pinned": self.pinned,
            "errors": dict(self.errors),
            "rollbacks": dict(self.rollbacks),
            "chunks": self.chunks,
            "chunks_dropped": self.chunks_dropped,
            "chunks_refused": list(self.chunks_refused),
            "skipped_blocks": [
                {"session_id": s.session_id, "index": s.index, "key": s.key, "reason": s.reason}
                for s in self.skipped
            ],
        }
