"""SQLAlchemy 2.0 persistence of a memory graph: nodes, edges and a meta table.

A SQLite file by default; any SQLAlchemy URL (e.g. PostgreSQL) or an existing
``Engine`` for shared deployments. Opening checks that the database holds a
memory graph of this schema built with the same embedding model and dimension.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import (
    Engine,
    Float,
    ForeignKey,
    Index,
    LargeBinary,
    String,
    Table,
    Text,
    UniqueConstraint,
    bindparam,
    create_engine,
    delete,
    event,
    insert,
    inspect,
    select,
    update,
)
from sqlalchemy.exc import DatabaseError, SQLAlchemyError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from memory_graph._errors import GraphStoreError, IncompatibleGraphStoreError

__all__ = ["STORE_SCHEMA_VERSION", "EdgeRow", "GraphStore", "MetaRow", "NodeRow", "StoredGraph"]

logger = logging.getLogger(__name__)

#: Version of the table layout below. Bump on any incompatible change.
STORE_SCHEMA_VERSION = 1

_SQLITE_MAGIC = b"SQLite format 3\x00"


class Base(DeclarativeBase):
    pass


class NodeRow(Base):
    """One memory node; ``embedding`` is the float32 unit vector's raw bytes."""

    __tablename__ = "mg_nodes"

    seq: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(String(64), unique=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    kind: Mapped[str] = mapped_column(String(32))
    text: Mapped[str] = mapped_column(Text)
    embedding: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[float] = mapped_column(Float)
    access_count: Mapped[int] = mapped_column(default=0)
    last_accessed: Mapped[float | None] = mapped_column(Float, default=None)


class EdgeRow(Base):
    """One typed, weighted edge between two nodes of the same tenant."""

    __tablename__ = "mg_edges"
    __table_args__ = (
        UniqueConstraint("src", "dst", "edge_type", name="uq_mg_edges_src_dst_type"),
        Index("ix_mg_edges_dst", "dst"),
    )

    seq: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    src: Mapped[str] = mapped_column(ForeignKey("mg_nodes.node_id", ondelete="CASCADE"))
    dst: Mapped[str] = mapped_column(ForeignKey("mg_nodes.node_id", ondelete="CASCADE"))
    edge_type: Mapped[str] = mapped_column(String(64))
    weight: Mapped[float] = mapped_column(Float)
    tenant: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[float] = mapped_column(Float)


class MetaRow(Base):
    """Key/value facts about the store: schema version, embedding model and dim."""

    __tablename__ = "mg_meta"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(256))


_TABLES = {t.name: {c.name for c in t.columns} for t in Base.metadata.sorted_tables}


@dataclass(frozen=True, slots=True)
class StoredGraph:
    """Everything read back from a store, in insertion order."""

    nodes: list[NodeRow]
    embeddings: np.ndarray  # [num_nodes, dim] float32
    edges: list[EdgeRow]


def _engine_for(target: str | Path | Engine) -> tuple[Engine, str]:
    if isinstance(target, Engine):
        return target, target.url.render_as_string(hide_password=True)
    text = str(target)
    if "://" in text:
        try:
            return create_engine(text), text
        except (SQLAlchemyError, ImportError, ValueError) as exc:
            raise GraphStoreError(f"cannot open database URL {text!r}: {exc}; check the URL "
                                  "and that its driver is installed") from exc
    path = Path(text).expanduser()
    if path.exists() and path.stat().st_size > 0:
        with path.open("rb") as fh:
            head = fh.read(len(_SQLITE_MAGIC))
        if head != _SQLITE_MAGIC:
            raise GraphStoreError(
                f"{path} is not a SQLite database (corrupt or another kind of file); move it "
                "away or pass another path to create a new memory graph store"
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(f"sqlite:///{path}")
    return engine, str(path)


def _sqlite_foreign_keys_on(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _enable_sqlite_foreign_keys(engine: Engine) -> None:
    # SQLite ignores FOREIGN KEY clauses unless each connection turns them on.
    if engine.dialect.name == "sqlite" and not event.contains(
            engine, "connect", _sqlite_foreign_keys_on):
        event.listen(engine, "connect", _sqlite_foreign_keys_on)


class GraphStore:
    """Nodes, edges and meta of memory graphs in one SQL database.

    Args:
        target: a file path (SQLite), an SQLAlchemy URL, or an ``Engine``.
        model_id: embedding model the graph's vectors come from.
        dim: embedding dimension.

    Raises:
        GraphStoreError: the target is not a database or cannot be opened.
        IncompatibleGraphStoreError: the database holds other tables, another
            schema version, or vectors of another embedding model or dimension.
    """

    def __init__(self, target: str | Path | Engine, *, model_id: str, dim: int) -> None:
        self.engine, self.where = _engine_for(target)
        self._owns_engine = not isinstance(target, Engine)
        _enable_sqlite_foreign_keys(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.model_id = model_id
        self.dim = dim
        try:
            self._open()
        except DatabaseError as exc:
            self.close()
            raise GraphStoreError(
                f"{self.where} cannot be read as a database ({exc.orig}); it is corrupt or "
                "not a database - move it away or pass another path/URL"
            ) from exc
        except GraphStoreError:
            self.close()
            raise

    def _open(self) -> None:
        tables = set(inspect(self.engine).get_table_names())
        ours = set(_TABLES)
        if not tables:
            Base.metadata.create_all(self.engine)
            self._write_meta()
            return
        if not tables & ours:
            raise IncompatibleGraphStoreError(
                f"{self.where} is a database of something else (tables {sorted(tables)[:8]}) "
                "and holds no memory graph; pass an empty database or a new path"
            )
        missing = ours - tables
        if missing:
            raise IncompatibleGraphStoreError(
                f"{self.where} lacks the memory graph tables {sorted(missing)}; it was not "
                "written by memory_graph (or was damaged) - pass a new path or restore it"
            )
        insp = inspect(self.engine)
        for name, want in _TABLES.items():
            have = {c["name"] for c in insp.get_columns(name)}
            if have != want:
                raise IncompatibleGraphStoreError(
                    f"{self.where}: table {name} has columns {sorted(have)}, expected "
                    f"{sorted(want)}; it was written by another schema version - migrate it "
                    "or pass a new path"
                )
        with self._sessions() as session:
            meta = {row.key: row.value for row in session.scalars(select(MetaRow))}
        version = meta.get("schema_version")
        if version != str(STORE_SCHEMA_VERSION):
            raise IncompatibleGraphStoreError(
                f"{self.where} has memory graph schema version {version}, this code reads "
                f"version {STORE_SCHEMA_VERSION}; use the matching contextkit release or pass "
                "a new path"
            )
        stored_model, stored_dim = meta.get("embedding_model_id"), meta.get("embedding_dim")
        if stored_model != self.model_id or stored_dim != str(self.dim):
            raise IncompatibleGraphStoreError(
                f"{self.where} holds embeddings of model {stored_model!r} (dim {stored_dim}), "
                f"but this graph embeds with {self.model_id!r} (dim {self.dim}); open it with "
                "that embedder, or re-embed the texts into a new store"
            )

    def _write_meta(self) -> None:
        with self._sessions.begin() as session:
            session.add_all([
                MetaRow(key="schema_version", value=str(STORE_SCHEMA_VERSION)),
                MetaRow(key="embedding_model_id", value=self.model_id),
                MetaRow(key="embedding_dim", value=str(self.dim)),
            ])

    # ------------------------------------------------------------------ reads
    def load(self) -> StoredGraph:
        """All nodes (with embeddings) and edges, in insertion order."""
        with self._sessions() as session:
            nodes = list(session.scalars(select(NodeRow).order_by(NodeRow.seq)))
            edges = list(session.scalars(select(EdgeRow).order_by(EdgeRow.seq)))
        emb = np.zeros((len(nodes), self.dim), dtype=np.float32)
        for i, row in enumerate(nodes):
            vec = np.frombuffer(row.embedding, dtype=np.float32)
            if vec.size != self.dim:
                raise IncompatibleGraphStoreError(
                    f"{self.where}: node {row.node_id} has a {vec.size}-dim embedding, expected "
                    f"{self.dim}; the store is damaged - re-embed into a new store"
                )
            emb[i] = vec
        return StoredGraph(nodes, emb, edges)

    # ------------------------------------------------------------------ writes
    def add_nodes(self, rows: Sequence[dict[str, object]]) -> None:
        """Insert node rows (``NodeRow`` column names) in one transaction."""
        if rows:
            with self._sessions.begin() as session:
                session.execute(insert(NodeRow), list(rows))

    def add_edges(self, rows: Sequence[dict[str, object]]) -> None:
        """Insert edge rows; an existing (src, dst, type) edge gets the new weight."""
        if not rows:
            return
        with self._sessions.begin() as session:
            self._upsert_edges(session, rows)

    @staticmethod
    def _upsert_edges(session: Session, rows: Sequence[dict[str, object]]) -> None:
        keys = [(r["src"], r["dst"], r["edge_type"]) for r in rows]
        srcs = {k[0] for k in keys}
        existing = {
            (e.src, e.dst, e.edge_type): e
            for e in session.scalars(select(EdgeRow).where(EdgeRow.src.in_(srcs)))
        }
        fresh = []
        for key, row in zip(keys, rows, strict=True):
            old = existing.get(key)  # type: ignore[arg-type]
            if old is None:
                fresh.append(row)
            else:
                old.weight = float(row["weight"])  # type: ignore[arg-type]
        if fresh:
            session.execute(insert(EdgeRow), fresh)

    def remove_node(self, node_id: str) -> None:
        with self._sessions.begin() as session:
            session.execute(delete(EdgeRow).where((EdgeRow.src == node_id) |
                                                  (EdgeRow.dst == node_id)))
            session.execute(delete(NodeRow).where(NodeRow.node_id == node_id))

    def update_access(self, stats: Iterable[tuple[str, int, float | None]]) -> None:
        """Write ``(node_id, access_count, last_accessed)`` for many nodes."""
        params = [{"p_id": n, "p_count": c, "p_last": t} for n, c, t in stats]
        if not params:
            return
        table = NodeRow.__table__
        assert isinstance(table, Table)
        stmt = (update(table)
                .where(table.c.node_id == bindparam("p_id"))
                .values(access_count=bindparam("p_count"), last_accessed=bindparam("p_last")))
        with self.engine.begin() as conn:
            conn.execute(stmt, params)

    def close(self) -> None:
        if self._owns_engine:
            self.engine.dispose()
