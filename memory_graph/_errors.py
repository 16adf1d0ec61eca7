"""Typed errors of memory_graph; every message says what to do."""

from __future__ import annotations

__all__ = [
    "EmbeddingModelNotFoundError",
    "GraphStoreError",
    "IncompatibleGraphStoreError",
    "MemoryGraphError",
    "UnknownNodeError",
    "UnknownReservationError",
]


class MemoryGraphError(Exception):
    """Base class of memory_graph errors."""


class EmbeddingModelNotFoundError(MemoryGraphError):
    """The embedding model could not be located."""


class GraphStoreError(MemoryGraphError):
    """The persistence store cannot be opened or read (e.g. not a database)."""


class IncompatibleGraphStoreError(GraphStoreError):
    """The database is not a memory graph of this schema / embedding model."""


class UnknownNodeError(MemoryGraphError, KeyError):
    """A node id that the graph does not hold (for this tenant)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnknownReservationError(MemoryGraphError, KeyError):
    """A reservation id that the reserver never issued (or for another tenant)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""
