"""Precision by semantic importance: which format each stored block gets.

The connector stores every block in one of gpu_cache's formats (``tq4`` < ``k5v4`` <
``int8`` < ``fp16`` < ``native``, low to high precision). A :class:`PrecisionPolicy` picks a
block's format from its position in the request (the first blocks are the attention
sink) and its semantic label (source layer, pinned, importance), so the blocks an
answer leans on most (axioms, identity, rules, the sink) keep more bits than old
memories and user turns.

The server's policy is ``kv_connector_extra_config["precision"]`` over the one its
``codec`` implies (:func:`policy_for_codec`); a request may carry a partial policy of
its own in ``kv_transfer_params["contextkit"]["precision"]`` (see
:func:`integrations.vllm.planning.semantic_params`).

This module imports neither vLLM nor ``gpu_cache`` (the connector's config is built
before vLLM starts its engine; see :mod:`integrations.vllm`), so it carries the format
names itself; a test pins them to :data:`gpu_cache.formats.FORMATS`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_POLICY",
    "FORMATS",
    "POLICY_KEYS",
    "RAISED_LAYERS",
    "BlockLabel",
    "LayerFormats",
    "PrecisionError",
    "PrecisionPolicy",
    "policy_for_codec",
    "vs_fp16",
]

#: Block formats, low to high precision (the same tuple as ``gpu_cache.formats.FORMATS``).
FORMATS: tuple[str, ...] = ("tq4", "k5v4", "int8", "fp16", "native")


@dataclass(frozen=True, slots=True)
class BlockLabel:
    """Semantic metadata of a stored block (drives the store's eviction, pins and the
    block's format: one of ``gpu_cache.formats.FORMATS``, set by the planner's
    :class:`PrecisionPolicy`)."""

    source_layer: str
    importance: float = 0.5
    pinned: bool = False
    fmt: str = "tq4"
    #: the format to store the block in while the DDR budget has room (above ``fmt``;
    #: the policy's :meth:`PrecisionPolicy.room_for`)
    room_fmt: str | None = None
    #: in the request's volatile tail (from the token its ``volatile_from`` names on,
    #: generated tokens included): the sender's next call changes it, so only an
    #: identical prompt (a retry, a replay) reuses it. Stored only while the DDR budget
    #: has room (``ConnectorConfig.store_volatile``).
    tail: bool = False
    #: pinned for this many seconds only (an agent hint's TTL: a tool-call pause), then
    #: an ordinary block again; None: a pin lasts (stable prefixes)
    keep_s: float | None = None


class PrecisionError(ValueError):
    """A precision policy names an unknown key or format, or a value of the wrong type."""


def _check_format(value: object, where: str) -> str:
    if not isinstance(value, str) or value not in FORMATS:
        raise PrecisionError(f"{where}: unknown block format {value!r}; write one of "
                             f"{', '.join(FORMATS)}")
    return value


class LayerFormats(Mapping[str, str]):
    """An immutable, hashable ``source layer -> format`` mapping."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, str] | None = None) -> None:
        self._items: dict[str, str] = dict(items or {})

    def __getitem__(self, key: str) -> str:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other.items())

    def __repr__(self) -> str:
        return f"LayerFormats({self._items!r})"


@dataclass(frozen=True, slots=True)
class PrecisionPolicy:
    """Per-block format rules; the first rule that matches a block decides.

    Args:
        default: format of blocks no rule matches.
        sink_blocks: the first ``sink_blocks`` blocks of every request (the attention
            sink: every later token attends to them) get ``sink_format``.
        sink_format: format of the sink blocks.
        layers: ``source layer -> format`` (e.g. ``{"axioms": "fp16"}``).
        pinned: format of pinned blocks; ``None``: no pinned rule.
        importance: ``(min importance, format)`` pairs tried in order (decreasing
            thresholds): a block whose importance is at least the threshold gets the
            format.
        key_offsets: the store subtracts per-head key means before quantizing ``tq4``,
            ``k5v4`` and ``int8`` blocks (and adds them back on load).
        max_vs_fp16: byte budget of a request's prompt blocks, as a share of fp16
            (``None``: no budget). When the rules above would store the prompt in
            more bytes, the blocks they raised above ``default`` (all but the sink)
            go back to ``default`` earliest first, so the budget keeps precision
            where the next tokens look most: the latest blocks (see
            :meth:`formats_for`).
        room_format: format a block is stored in while the connector's DDR budget has
            room, when it is above the one the rules give (``None``: never). Under
            pressure the store transcodes such blocks back down to their rules'
            format, lowest eviction priority first, before it evicts anything: the
            store keeps more bits when bytes are free and TQ4's density when they
            are not (see :meth:`room_for`).

    Raises:
        PrecisionError: an unknown format, a negative ``sink_blocks``, thresholds
            outside [0, 1] or not decreasing.
    """

    default: str = "tq4"
    sink_blocks: int = 1
    sink_format: str = "fp16"
    layers: Mapping[str, str] = dataclasses.field(default_factory=LayerFormats)
    pinned: str | None = None
    importance: tuple[tuple[float, str], ...] = ()
    key_offsets: bool = True
    max_vs_fp16: float | None = None
    room_format: str | None = None

    def __post_init__(self) -> None:
        _check_format(self.default, "precision.default")
        if self.room_format is not None:
            _check_format(self.room_format, "precision.room_format")
        _check_format(self.sink_format, "precision.sink_format")
        if self.pinned is not None:
            _check_format(self.pinned, "precision.pinned")
        if (not isinstance(self.sink_blocks, int) or isinstance(self.sink_blocks, bool)
                or self.sink_blocks < 0):
            raise PrecisionError(f"precision.sink_blocks: write an integer >= 0, got "
                                 f"{self.sink_blocks!r}")
        if not isinstance(self.key_offsets, bool):
            raise PrecisionError(f"precision.key_offsets: write true or false, got "
                                 f"{self.key_offsets!r}")
        if self.max_vs_fp16 is not None:
            budget = self.max_vs_fp16
            if (isinstance(budget, bool) or not isinstance(budget, (int, float))
                    or not math.isfinite(budget) or budget <= 0):
                raise PrecisionError(f"precision.max_vs_fp16: write a number > 0 (the "
                                     f"share of fp16 bytes, e.g. 0.35) or null, got "
                                     f"{budget!r}")
            object.__setattr__(self, "max_vs_fp16", float(budget))
        object.__setattr__(self, "layers", _layers(self.layers))
        object.__setattr__(self, "importance", _importance(self.importance))

    def format_for(self, block_index: int, label: BlockLabel) -> str:
        """The format of block ``block_index`` (within its request) labelled ``label``.

        Rules in order: sink, source layer, pinned, importance thresholds, default.
        """
        if block_index < self.sink_blocks:
            return self.sink_format
        fmt = self.layers.get(label.source_layer)
        if fmt is not None:
            return fmt
        if label.pinned and self.pinned is not None:
            return self.pinned
        for threshold, fmt in self.importance:
            if label.importance >= threshold:
                return fmt
        return self.default

    def formats_for(self, labels: Sequence[BlockLabel], head_dim: int) -> list[str]:
        """Formats of a request's prompt blocks ``0..len(labels)-1``: the rules of
        :meth:`format_for`, then the byte budget ``max_vs_fp16``.

        Over budget, blocks the rules raised above ``default`` (the sink excepted) go
        back to ``default`` from the earliest on, until the prompt fits: what stays
        raised is the latest context, whose errors the next tokens feel most (the
        bench measures this; the stable layers at the front tolerate 4 bits). A
        prompt whose sink alone breaks the budget keeps its sink.
        """
        out = [self.format_for(b, label) for b, label in enumerate(labels)]
        if self.max_vs_fp16 is None or not out:
            return out
        cost = {fmt: vs_fp16(fmt, head_dim) for fmt in {*out, self.default}}
        budget = self.max_vs_fp16 * len(out)
        total = sum(cost[fmt] for fmt in out)
        base = cost[self.default]
        for b in range(self.sink_blocks, len(out)):
            if total <= budget:
                break
            if cost[out[b]] > base:
                total -= cost[out[b]] - base
                out[b] = self.default
        return out

    def room_for(self, fmt: str) -> str | None:
        """The format a block the rules gave ``fmt`` is stored in while the DDR budget
        has room: :attr:`room_format` when it is above ``fmt``, else ``None``."""
        if self.room_format is None or FORMATS.index(self.room_format) <= FORMATS.index(fmt):
            return None
        return self.room_format

    def formats(self) -> frozenset[str]:
        """Every format this policy can assign."""
        out = {self.default, *self.layers.values(), *(f for _, f in self.importance)}
        if self.sink_blocks:
            out.add(self.sink_format)
        if self.pinned is not None:
            out.add(self.pinned)
        if self.room_format is not None:
            out.add(self.room_format)
        return frozenset(out)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None,
                     base: PrecisionPolicy | None = None) -> PrecisionPolicy:
        """``base`` (default :data:`DEFAULT_POLICY`) with the keys of ``data`` set.

        ``data`` is what a config or a request says: ``{"default": "tq4",
        "sink_blocks": 1, "sink_format": "fp16", "layers": {"axioms": "fp16"},
        "pinned": "int8", "importance": [[0.8, "int8"]], "key_offsets": true}``, any
        subset. ``importance`` may also be a ``{threshold: format}`` mapping (tried
        from the highest threshold down).

        Raises:
            PrecisionError: an unknown key or format, or a value of the wrong type
                (one line naming the key and what to write).
        """
        base = DEFAULT_POLICY if base is None else base
        if data is None:
            return base
        if not isinstance(data, Mapping):
            raise PrecisionError(f"precision: write a mapping of policy keys (e.g. "
                                 f'{{"default": "tq4"}}), got {data!r}')
        unknown = sorted(str(k) for k in data if k not in POLICY_KEYS)
        if unknown:
            raise PrecisionError(f"unknown precision key {unknown[0]!r}; known keys: "
                                 f"{', '.join(POLICY_KEYS)}")
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key == "importance" and isinstance(value, Mapping):
                value = sorted(((_threshold(t, f"precision.importance[{t!r}]"), f)
                                for t, f in value.items()), key=lambda p: -p[0])
            if key == "sink_blocks" and isinstance(value, float) and value.is_integer():
                value = int(value)
            values[key] = value
        try:
            return dataclasses.replace(base, **values)
        except PrecisionError:
            raise
        except (TypeError, ValueError) as exc:  # defensive: a type no check above named
            raise PrecisionError(f"precision: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain (JSON) values; :meth:`from_mapping` of it gives this policy back."""
        return {"default": self.default, "sink_blocks": self.sink_blocks,
                "sink_format": self.sink_format, "layers": dict(self.layers),
                "pinned": self.pinned, "importance": [[t, f] for t, f in self.importance],
                "key_offsets": self.key_offsets, "max_vs_fp16": self.max_vs_fp16,
                "room_format": self.room_format}


#: The keys of a precision mapping (``PrecisionPolicy``'s fields).
POLICY_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(PrecisionPolicy))


def _layers(value: object) -> LayerFormats:
    if isinstance(value, LayerFormats):
        return value
    if not isinstance(value, Mapping):
        raise PrecisionError(f"precision.layers: write a mapping of source layer to format "
                             f'(e.g. {{"axioms": "fp16"}}), got {value!r}')
    out = {}
    for layer, fmt in value.items():
        if not isinstance(layer, str) or not layer:
            raise PrecisionError(f"precision.layers: source layer names are non-empty "
                                 f"strings, got {layer!r}")
        out[layer] = _check_format(fmt, f"precision.layers.{layer}")
    return LayerFormats(out)


def _threshold(value: object, where: str) -> float:
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not 0.0 <= value <= 1.0):
        raise PrecisionError(f"{where}: an importance threshold is a number in [0, 1], "
                             f"got {value!r}")
    return float(value)


def _importance(value: object) -> tuple[tuple[float, str], ...]:
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        raise PrecisionError(f"precision.importance: write a list of [min importance, "
                             f'format] pairs (e.g. [[0.8, "int8"]]), got {value!r}')
    rules: list[tuple[float, str]] = []
    for i, pair in enumerate(value):
        where = f"precision.importance[{i}]"
        if isinstance(pair, (str, bytes)) or not hasattr(pair, "__len__") or len(pair) != 2:
            raise PrecisionError(f"{where}: write a [min importance, format] pair, "
                                 f"got {pair!r}")
        rules.append((_threshold(pair[0], where), _check_format(pair[1], where)))
    for (before, _), (after, _) in itertools.pairwise(rules):
        if after >= before:
            raise PrecisionError(
                f"precision.importance: rules are tried in order, so thresholds must "
                f"decrease (a later rule {after} after {before} never matches); got "
                f"{[t for t, _ in rules]}")
    return tuple(rules)


def vs_fp16(fmt: str, head_dim: int) -> float:
    """Bytes of a token-head in ``fmt`` over its fp16 bytes (``2 * head_dim``); the
    same sizes as :func:`gpu_cache.formats.bytes_per_token_head`."""
    per = {"tq4": head_dim // 2 + 4, "k5v4": head_dim * 9 // 16 + 4, "int8": head_dim + 4,
           "fp16": 2 * head_dim, "native": 4 * head_dim}
    return per[_check_format(fmt, "format")] / (2 * head_dim)


#: Source layers whose blocks the default policy raises to int8: the layers that change
#: per turn and sit late in the prompt (memories, the volatile state, the user turn),
#: which the next tokens attend to most. The stable layers at the front (axioms,
#: identity, rules, capabilities, soul) stay at the default: measured, they tolerate it.
RAISED_LAYERS: tuple[str, ...] = ("partner", "neurons", "memories", "system_state",
                                  "current_time", "affect", "awareness", "user_turn")

#: The policy of a ``codec="tq4"`` server without a ``precision`` setting: an fp16
#: attention sink, key offsets, the late layers int8 within 0.35 of fp16's bytes per
#: request, everything else ``k5v4`` (5-bit keys, 4-bit values: 0.3125 of fp16; nearly
#: all of tq4's error after a round trip is in the keys). See docs/vllm.md, "Precision
#: by semantic importance". A store of many short requests may sit a little above
#: 0.35: the budget never takes back a sink (a 2-block request's fp16 sink alone is
#: 0.64 of its fp16 bytes). While the DDR budget has room, k5v4 blocks are stored int8
#: (``room_format``) and transcoded back as it fills: under pressure the store holds
#: the bytes above; with room, ~0.5 of fp16.
DEFAULT_POLICY = PrecisionPolicy(
    default="k5v4", sink_blocks=1, sink_format="fp16",
    layers=dict.fromkeys(RAISED_LAYERS, "int8"), key_offsets=True, max_vs_fp16=0.35,
    room_format="int8")


def policy_for_codec(codec: str) -> PrecisionPolicy:
    """The policy a connector ``codec`` implies before its ``precision`` setting.

    ``"tq4"``: :data:`DEFAULT_POLICY`; ``"native"`` (exact, the old check mode): every
    block native, no sink rule, no key offsets; any other format: the default policy
    with that format as its ``default``.

    Raises:
        PrecisionError: ``codec`` is not a known format.
    """
    _check_format(codec, "codec")
    if codec == "tq4":
        return DEFAULT_POLICY
    if codec == "native":
        return PrecisionPolicy(default="native", sink_blocks=0, key_offsets=False)
    return dataclasses.replace(DEFAULT_POLICY, default=codec)
