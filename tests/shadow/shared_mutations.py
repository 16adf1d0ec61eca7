"""Seeded mutations of shared-tier objects for the fuzz tests: what a writer without
the key (byte edits, forged headers) or with it (any header, signed) can put at a
chunk's name. Imported by tests/shadow and tests/integrations/vllm."""

from __future__ import annotations

import copy
import json
import random
import struct
from dataclasses import dataclass
from typing import Any

from shadow.shared.objects import MAC_BYTES, MAGIC, PREFIX_BYTES, assemble_object, split_object

#: Values a hostile header field takes.
HOSTILE: list[Any] = [None, True, False, -1, 0, 1, 2**63, -(2**63), 1e308, -1e308, 1e300,
                      float("nan"), float("inf"), float("-inf"), "x", "", "zz" * 600, [], {},
                      [1], [None], {"a": 1}, [[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]], 0.5, "NaN",
                      "0" * 64, 99, 4.0e9]


@dataclass
class Mutation:
    """A mutated object and what the mutation did: ``signed`` (with the key) and
    ``header`` (whether the header, as signed by the writer of the original, changed)."""

    name: str
    data: bytes
    signed: bool
    header: bool


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _edit(doc: Any, path: tuple[Any, ...], rng: random.Random) -> None:
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    kind = rng.random()
    if kind < 0.15 and isinstance(parent, dict):
        del parent[last]
    elif kind < 0.25 and isinstance(parent, dict):
        parent["extra"] = rng.choice(HOSTILE)
    elif kind < 0.35 and isinstance(parent[last], int | float) and not isinstance(
            parent[last], bool):
        parent[last] = parent[last] + rng.choice([-1, 1, 7, 1 << 20])
    else:
        parent[last] = copy.deepcopy(rng.choice(HOSTILE))


def signed(data: bytes, rng: random.Random, key: bytes) -> Mutation:
    """Header fields changed, removed or added, then signed with the key (a writer
    running other code), or the body cut and the object signed again."""
    doc, body = split_object(data)
    if rng.random() < 0.1:
        cut = rng.randrange(len(body) + 1)
        return Mutation("signed body cut", assemble_object(doc, bytes(body)[:cut], key),
                        True, False)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        paths = _paths(doc)
        _edit(doc, rng.choice(paths), rng)
    raw = json.dumps(doc).encode()  # NaN and Infinity as JSON's extensions write them
    return Mutation("signed header", assemble_object(raw, bytes(body), key), True, True)


def unsigned(data: bytes, rng: random.Random, limit: int) -> Mutation:
    """Byte edits and forged headers, without the key; ``limit``: the largest legal
    object (some mutations go past it)."""
    n = struct.unpack_from("<I", data, len(MAGIC))[0]
    header_end = PREFIX_BYTES + n + MAC_BYTES
    kind = rng.randrange(7)
    if kind == 0:
        pos = rng.randrange(len(data))
        out = bytearray(data)
        out[pos] ^= 1 << rng.randrange(8)
        return Mutation("bit flip", bytes(out), False, pos < header_end)
    if kind == 1:
        cut = rng.randrange(len(data))
        return Mutation("truncated", data[:cut], False, cut < header_end)
    if kind == 2:
        extra = rng.choice([1, 64, limit, 8 * limit])
        return Mutation("extended", data + rng.randbytes(extra), False, False)
    if kind == 3:
        declared = rng.choice([0, 1, n - 1, n + 1, 1 << 20, (1 << 20) + 1, 0xFFFFFFFF])
        return Mutation("header length", MAGIC + struct.pack("<I", declared)
                        + data[PREFIX_BYTES:], False, True)
    if kind == 4:
        return Mutation("random", MAGIC + rng.randbytes(rng.randrange(200)), False, True)
    doc, body = split_object(data)
    if kind == 5:  # everything that keeps an object: pinned, important, new
        for b in doc.get("blocks", []):
            b.update(importance=1.0, pinned=True)
        doc["written_at"] = rng.choice([1e300, 4.0e9, float("inf")])
    else:
        _edit(doc, rng.choice(_paths(doc)), rng)
    header = json.dumps(doc).encode()
    forged = (MAGIC + struct.pack("<I", len(header)) + header + rng.randbytes(MAC_BYTES)
              + bytes(body) + rng.randbytes(MAC_BYTES))
    return Mutation("forged header", forged, False, True)
