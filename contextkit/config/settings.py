"""The sections of the configuration that contextkit itself defines (see :mod:`contextkit.config`).

Each is a frozen dataclass whose field defaults are the only defaults; the sections
other packages define (``pins``: :class:`gpu_cache.PinConfig`, ``tiers``:
:class:`contextkit.loop.tiers.TierManagerConfig`, ``connector``) live with their code.
Public path: :mod:`contextkit.config`, which re-exports every name here.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contextkit.config.errors import ConfigError

if typing.TYPE_CHECKING:
    from gpu_cache.config import CacheConfig, PinConfig

__all__ = ["KV_FORMATS", "CacheSettings", "EngineSettings", "MetricsSettings",
           "PipelineSettings", "ShadowSettings"]

#: The KV formats of :class:`contextkit.engine.Engine`: packed 4-bit, or float32 (exact).
KV_FORMATS = ("tq4", "native")


#: The weight formats of :class:`contextkit.engine.Engine`
#: (:mod:`contextkit.engine.weights`), the reference first.
WEIGHT_FORMATS = ("float32", "bfloat16", "int8")


def check_weight_format(weight_format: str) -> str:
    """``weight_format`` if it is one of :data:`WEIGHT_FORMATS`.

    Raises:
        ValueError: any other value (one line naming the choices).
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}; got "
                         f"{weight_format!r}")
    return weight_format


def check_int(name: str, value: Any, minimum: int, *, none: str | None = None) -> None:
    """Refuse ``value`` unless it is an integer (not a bool) >= ``minimum``; ``none``
    says what ``None`` means when it is allowed."""
    if value is None and none is not None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        also = f" or None ({none})" if none is not None else ""
        raise ValueError(f"{name} must be an integer >= {minimum}{also}, got {value!r}")


def _check_fraction(name: str, value: Any) -> None:
    """Refuse ``value`` unless it is a finite number in [0, 1] (not a bool)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or not 0.0 <= float(value) <= 1.0):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


def _check_text(name: str, value: Any, none: str) -> None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name} must be a string or None ({none}), got {value!r}")


def _default_cache_dir() -> str:
    return str(Path.home() / ".cache" / "contextkit")


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """The block cache the engine builds, and where contextkit keeps converted models.

    Args:
        dir: directory of converted model weights and the connector's local store.
        num_device_blocks: blocks of the device ("VRAM") tier.
        num_host_blocks: blocks of the host ("DDR") tier.
        device: device of the device tier; ``None`` picks CUDA when present.
        eviction_policy: ``"semantic"`` (layer priority, importance, recency) or ``"lru"``.
        block_size: tokens per block.
    """

    dir: str = dataclasses.field(default_factory=_default_cache_dir)
    num_device_blocks: int = 1024
    num_host_blocks: int = 2048
    device: str | None = None
    eviction_policy: str = "semantic"
    block_size: int = 16

    def __post_init__(self) -> None:
        from gpu_cache.config import PinConfig

        if not isinstance(self.dir, str):
            raise ValueError(f"dir must be a directory path (a string), got {self.dir!r}")
        _check_text("device", self.device, "CUDA when present")
        check_int("num_device_blocks", self.num_device_blocks, 1)
        check_int("num_host_blocks", self.num_host_blocks, 0)
        check_int("block_size", self.block_size, 1)
        # CacheConfig owns the checks of what else it shares with these settings.
        self.cache_config(PinConfig())

    def cache_config(self, pins: PinConfig) -> CacheConfig:
        """The :class:`gpu_cache.CacheConfig` of these settings and ``pins``."""
        from gpu_cache.config import CacheConfig

        return CacheConfig(num_device_blocks=self.num_device_blocks,
                           num_host_blocks=self.num_host_blocks, device=self.device,
                           eviction_policy=self.eviction_policy, pins=pins)


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """The embedded engine (:class:`contextkit.engine.engine.Engine`).

    Args:
        model: a local transformers model directory; ``None``: the packaged SmolLM2.
        kv_format: ``"tq4"`` (packed 4-bit) or ``"native"`` (float32, exact).
        weight_format: ``"float32"`` (default: as loaded, the reference),
            ``"bfloat16"`` or ``"int8"`` (per-channel weight-only: a quarter of
            float32's bytes per decoded token; the demo's and ``bench decode``'s
            default).
        calibrate: per-head key offsets (tq4).
        prefill_chunk: prompt tokens per forward step.
        residual_tokens: float32 recent window over the TQ4 cache.
        sink_tokens: float32 attention sink (a multiple of ``cache.block_size``);
            ``None``: one block.
        max_positions: longest prompt plus reply a request may span; ``None``: the
            model's trained context (larger values let RoPE run past it).
        chunk_reuse: reuse layers and turns found cached at other positions past the
            cached prefix, repairing the seams (:mod:`contextkit.engine.chunks`).
        chunk_layers: the labels that may be reused that way, comma-separated (layer
            sources such as ``rules``, and ``user_turn`` for conversation turns);
            ``None``: every label. The per-layer switch.
        chunk_repair_ratio: share of a request's reused chunk tokens recomputed, [0, 1].
        chunk_repair_rule: ``deviation`` (largest K/V deviation at an early layer),
            ``first`` (each chunk's first tokens) or ``both``.
        chunk_edits: align a line whose text changed against its cached version and
            reuse the tokens they share (``false``: such a line is computed whole).
        chunk_max_hops: K/V moved this many times since a full computation are not
            moved again: the chunk is computed whole (bounds drift).
    """

    model: str | None = None
    kv_format: str = "tq4"
    weight_format: str = "float32"
    calibrate: bool = True
    prefill_chunk: int = 4096
    residual_tokens: int = 128
    sink_tokens: int | None = None
    max_positions: int | None = None
    chunk_reuse: bool = True
    chunk_layers: str | None = None
    chunk_repair_ratio: float = 0.15
    chunk_repair_rule: str = "both"
    chunk_edits: bool = True
    chunk_max_hops: int = 4

    def chunk_reuse_fields(self) -> dict[str, Any]:
        """The :class:`contextkit.engine.chunks.ChunkReuse` fields these settings name."""
        labels = None if self.chunk_layers is None else tuple(
            part.strip() for part in self.chunk_layers.split(",") if part.strip())
        return {"enabled": self.chunk_reuse, "labels": labels,
                "repair_ratio": self.chunk_repair_ratio, "repair_rule": self.chunk_repair_rule,
                "edits": self.chunk_edits, "max_hops": self.chunk_max_hops}

    @staticmethod
    def chunk_settings_of(reuse: Any) -> dict[str, Any]:
        """The fields of these settings that a ``ChunkReuse`` sets (the reverse of
        :meth:`chunk_reuse_fields`; its other knobs have no setting)."""
        labels = None if reuse.labels is None else ",".join(reuse.labels)
        return {"chunk_reuse": reuse.enabled, "chunk_layers": labels,
                "chunk_repair_ratio": reuse.repair_ratio,
                "chunk_repair_rule": reuse.repair_rule, "chunk_edits": reuse.edits,
                "chunk_max_hops": reuse.max_hops}

    def chunk_reuse_kwargs(self) -> dict[str, Any] | bool:
        """``False``, or the ``ChunkReuse`` keyword arguments of these settings."""
        if not self.chunk_reuse:
            return False
        fields = self.chunk_reuse_fields()
        del fields["enabled"]
        return fields

    def __post_init__(self) -> None:
        _check_text("model", self.model, "the packaged SmolLM2")
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {', '.join(KV_FORMATS)}, got "
                             f"{self.kv_format!r}")
        check_weight_format(self.weight_format)
        _check_bool("calibrate", self.calibrate)
        check_int("prefill_chunk", self.prefill_chunk, 1)
        check_int("residual_tokens", self.residual_tokens, 0)
        check_int("sink_tokens", self.sink_tokens, 0, none="one block")
        check_int("max_positions", self.max_positions, 1, none="the model's trained context")
        _check_bool("chunk_reuse", self.chunk_reuse)
        _check_text("chunk_layers", self.chunk_layers, "every label")
        _check_fraction("chunk_repair_ratio", self.chunk_repair_ratio)
        if self.chunk_repair_rule not in ("deviation", "first", "both"):
            raise ValueError("chunk_repair_rule must be 'deviation', 'first' or 'both', got "
                             f"{self.chunk_repair_rule!r}")
        _check_bool("chunk_edits", self.chunk_edits)
        check_int("chunk_max_hops", self.chunk_max_hops, 0)


@dataclass(frozen=True, slots=True)
class PipelineSettings:
    """The cache-aware pipeline (:class:`contextkit.pipeline.pipeline.CacheAwareContextPipeline`).

    Args:
        tenant: the default tenant of calls that name none.
        reorder: volatility-aware layer ordering.
        trailing_message: volatile layers in a system message after the conversation.
        pin_stable: pin the stable prefix (within the tenant's pin quota; a prefix over
            it is served unpinned with a warning); ``"strict"`` refuses such a call
            before any work (``PinCapacityError``).
        volatility_alpha: weight of the newest observation in a layer's change rate.
        max_tenants: tenants whose state (change rates, last report) is kept; past it
            the least recently built for is released.
    """

    tenant: str = "default"
    reorder: bool = True
    trailing_message: bool = True
    pin_stable: bool | str = True
    volatility_alpha: float = 0.3
    max_tenants: int = 1024

    def __post_init__(self) -> None:
        from gpu_cache import validate_tenant

        check_int("max_tenants", self.max_tenants, 1)
        validate_tenant(self.tenant)
        if self.pin_stable not in (True, False, "strict"):
            raise ValueError(f"pin_stable must be true, false or \"strict\", got "
                             f"{self.pin_stable!r}")
        if not 0.0 < self.volatility_alpha <= 1.0:
            raise ValueError(f"volatility_alpha must be in (0, 1], got {self.volatility_alpha}")


#: ShadowSettings fields passed on to shadow.StoreConfig when set.
_S3_CLIENT_FIELDS = ("retry_mode", "max_attempts", "connect_timeout_s", "read_timeout_s",
                     "max_pool_connections")


@dataclass(frozen=True, slots=True)
class ShadowSettings:
    """The cold-tier shadow (:mod:`shadow`).

    Args:
        url: ``file:///path`` or ``s3://bucket/prefix``; empty: no shadow.
        key: MAC key of manifests and the index (secret; never printed).
        session_id: the session this process shadows under.
        interval_seconds: period of the background shadow.
        allow_unauthenticated: restore unsigned sessions from an ``s3://`` store.
        upload_abort_after_seconds: age past which incomplete S3 uploads are aborted.
        endpoint_url: S3-compatible endpoint (MinIO, Ceph, moto); ``None``: boto3's.
        region_name: S3 region; ``None``: boto3's.
        retry_mode: the S3 client's retry mode; ``None``: :class:`shadow.StoreConfig`'s
            default (as for the four below).
        max_attempts: the S3 client's attempts per call.
        connect_timeout_s: the S3 client's connect timeout.
        read_timeout_s: the S3 client's read timeout.
        max_pool_connections: the S3 client's connection pool size.
    """

    url: str = ""
    key: str | None = None
    session_id: str = "default"
    interval_seconds: float = 60.0
    allow_unauthenticated: bool = False
    upload_abort_after_seconds: float = 3600.0
    endpoint_url: str | None = None
    region_name: str | None = None
    retry_mode: str | None = None
    max_attempts: int | None = None
    connect_timeout_s: float | None = None
    read_timeout_s: float | None = None
    max_pool_connections: int | None = None

    def __post_init__(self) -> None:
        if self.url and "://" not in self.url:
            raise ValueError(f"url must be file:///path or s3://bucket/prefix, got {self.url!r}")
        self.shadow_config()
        self.store_config()

    def shadow_config(self, **kwargs: Any) -> Any:
        """A :class:`shadow.ShadowConfig` of these settings (``kwargs`` override)."""
        from shadow import ShadowConfig

        values: dict[str, Any] = {
            "interval_seconds": self.interval_seconds, "auth_key": self.key,
            "allow_unauthenticated": self.allow_unauthenticated,
            "upload_abort_after_seconds": self.upload_abort_after_seconds}
        values.update(kwargs)
        return ShadowConfig(**values)

    def store_config(self) -> Any:
        """A :class:`shadow.StoreConfig` of these settings."""
        from shadow import StoreConfig

        client = {name: getattr(self, name) for name in _S3_CLIENT_FIELDS
                  if getattr(self, name) is not None}
        return StoreConfig(endpoint_url=self.endpoint_url, region_name=self.region_name,
                           **client)

    def _require_url(self) -> str:
        if not self.url:

            raise ConfigError("no shadow store configured; set shadow.url (file:///path or "
                              "s3://bucket/prefix) in the configuration file or "
                              "$CONTEXTKIT_SHADOW_URL")
        return self.url

    def open_store(self, *, create: bool = True) -> Any:
        """The :class:`shadow.ShadowStore` at ``url`` (``endpoint_url``, ``region_name``).

        Args:
            create: writers leave this on (a ``file://`` directory is created); readers
                pass ``False``, so a directory that does not exist is an error.

        Raises:
            ConfigError: ``url`` is empty (no shadow configured).
            ShadowStoreError: an unknown scheme, or no directory with ``create=False``.
        """
        from shadow import open_store

        return open_store(self._require_url(), self.store_config(), create=create)

    def cache_shadow(self, cache: Any, *, session_id: str | None = None,
                     **kwargs: Any) -> Any:
        """A :class:`shadow.CacheShadow` of ``cache`` in the store at ``url``.

        Args:
            cache: the :class:`gpu_cache.TQGPUCache` to shadow (``engine.cache``).
            session_id: the session to write (default: ``session_id`` of this section).
            **kwargs: other :class:`shadow.ShadowConfig` fields (``autostart=False``,
                ``tenant=...``); they win over this section's.

        Raises:
            ConfigError: ``url`` is empty (no shadow configured).
        """
        from shadow import CacheShadow

        return CacheShadow(cache, self._require_url(), session_id or self.session_id,
                           config=self.shadow_config(**kwargs),
                           store_config=self.store_config())


@dataclass(frozen=True, slots=True)
class MetricsSettings:
    """Prometheus export (:mod:`contextkit.metrics`).

    Args:
        enabled: record metrics at all.
        port: serve ``/metrics`` on this port (127.0.0.1 unless ``addr`` says otherwise);
            ``None``: do not serve (a host process such as vLLM exports them).
        addr: address of that server.
        max_tenant_labels: distinct tenants labelled by name; later ones share the label
            ``"other"`` (keeps the series count bounded).
    """

    enabled: bool = True
    port: int | None = None
    addr: str = "127.0.0.1"
    max_tenant_labels: int = 32

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535] or None, got {self.port}")
        if self.max_tenant_labels < 1:
            raise ValueError(f"max_tenant_labels must be >= 1, got {self.max_tenant_labels}")
