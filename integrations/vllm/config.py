"""Typed configuration of the vLLM connector (``kv_connector_extra_config``)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contextkit.config import ConfigError, load_config
from contextkit.config.limits import json_object, seconds, size
from integrations.vllm.precision import FORMATS, PrecisionError, PrecisionPolicy, policy_for_codec

#: The DDR tier's eviction policies (the keys of gpu_cache.metadata.EVICTION_POLICIES,
#: named here so this module stays numba-free).
EVICTION_POLICIES = ("semantic", "lru")
#: When the DDR tier stores a request's volatile tail (``ConnectorConfig.store_volatile``).
STORE_VOLATILE = ("room", "always")
#: The dtype of the connector forward's projections (``ConnectorConfig.chunk_matmul_dtype``).
MATMUL_DTYPES = ("auto", "model", "bfloat16")

if TYPE_CHECKING:
    from gpu_cache.config import PinConfig
    from shadow.shared.tier import SharedTierConfig

__all__ = [
    "CONNECTOR_CLASS",
    "CONNECTOR_MODULE",
    "MATMUL_DTYPES",
    "ConnectorConfig",
    "ConnectorConfigError",
    "kv_transfer_config",
    "pin_advice",
]

#: What ``--kv-transfer-config`` names: the class and its module.
CONNECTOR_CLASS = "ContextKitConnector"
CONNECTOR_MODULE = "integrations.vllm.connector"


class ConnectorConfigError(ValueError):
    """``kv_connector_extra_config`` has an unknown key or a bad value."""


def _default_local_store() -> str:
    root = Path(os.environ.get("CONTEXTKIT_CACHE_DIR", Path.home() / ".cache" / "contextkit"))
    return f"file://{root / 'vllm-store'}"


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Options of :class:`integrations.vllm.connector.ContextKitConnector`.

    Every field can be set in ``kv_connector_extra_config``; unknown keys are refused
    so a typo never silently falls back to a default.

    Args:
        block_size: tokens per block; must equal vLLM's ``--block-size`` (the
            connector moves whole vLLM blocks, and the cache identity records it).
        codec: the key identity's block format (``host_blocks`` count blocks of it)
            and what sets the policy below: ``"tq4"`` (4-bit TurboQuant, default)
            implies :data:`~integrations.vllm.precision.DEFAULT_POLICY` (``k5v4``
            blocks, the latest ones int8); ``"k5v4"``, ``"int8"`` or ``"fp16"`` make
            that format the ``default``; ``"native"`` (float32, exact; for checks)
            stores every block native, no sink rule, no key offsets.
        shadow_url: durable cold tier, ``file:///path`` or ``s3://bucket/prefix``;
            empty disables shadowing (the store then lives as long as the process).
        session_id: the session this server shadows under (one writer per session:
            give each vLLM instance sharing a shadow store its own id).
        local_store: where ``contextkit recover --for-vllm`` stages the verified
            blocks that the connector loads into its DDR tier at start.
        host_blocks: blocks of the DDR ("host") tier.
        device_blocks: blocks of the device tier (on CUDA, VRAM beside vLLM's own
            paged cache; pinned prefixes live there). On CPU both tiers are RAM.
        pin_share: share of ``device_blocks`` one tenant's pinned blocks may take
            (all tenants' pins together: ``max(pin_share, 0.75)``). A stable prefix
            needing more is stored unpinned, and the log says how many blocks it
            needs and what to raise (:func:`pin_advice`).
        device: device of the device tier; ``None`` picks CUDA when present.
        shadow_on_save: shadow after every completed save (in the save thread).
        shadow_interval_s: period of the background shadow (0: none).
        save_threads: threads of the save thread's quantizing kernels (default 1).
            On a CPU server saves run beside vLLM's forward, whose OpenMP threads
            are bound to every core: each extra save thread takes a core from a
            forward thread, which then holds up the whole step.
        stats_path: append one JSON line per finished request (hit tokens, saves).
        model_id: name recorded in the cache identity; default: a fingerprint of
            the weights, so another model (or fine-tune) never matches.
        endpoint_url: S3-compatible endpoint for an ``s3://`` shadow.
        default_source_layer: source layer of blocks without a span label.
        precision: the per-block format policy over the one ``codec`` implies, as a
            mapping (or its JSON text, e.g. from ``CONTEXTKIT_CONNECTOR_PRECISION``)
            of :class:`~integrations.vllm.precision.PrecisionPolicy` keys, e.g.
            ``{"layers": {"axioms": "fp16"}, "importance": [[0.8, "int8"]]}``; the
            effective policy is :attr:`policy`.
        eviction: how the DDR tier picks what to drop when a save needs room:
            ``"semantic"`` (default: lowest layer priority, then importance, then least
            recently attended) or ``"lru"`` (least recently attended first, whatever
            the block is). Pinned blocks are never dropped under either.
        store_volatile: when the DDR tier stores a request's volatile tail (the
            blocks from its ``volatile_from`` on, e.g. contextkit's trailing message of
            volatile layers and the turn after it, which the sender's next call
            changes): ``"room"`` (default) only while the save fits the byte budget
            without evicting anything; ``"always"`` like every other block. Under
            pressure, skipping them saves their encoding and the room they take;
            only an identical prompt (a retry, a replay after a restart) would reuse
            them.
        shared_url: the live shared tier every replica of this model reads and
            writes while serving (``s3://bucket/prefix`` or ``file:///shared/path``;
            empty: none). Needs the deployment's MAC key on every replica
            (``CONTEXTKIT_SHADOW_KEY``). A lookup that misses the DDR tier asks it
            for the prompt's chunks; saves are uploaded behind (see
            :mod:`shadow.shared` and :mod:`integrations.vllm.shared`).
        shared_endpoint_url: its S3 endpoint (default: ``endpoint_url``).
        shared_chunk_blocks: blocks per shared object (a prompt's chunks are
            aligned on it; only whole chunks are shared).
        shared_deadline_s: a shared lookup or load that takes longer gives up; the
            request recomputes (counted in ``shared_deadline_misses``).
        shared_max_age_s: unleased objects are collected after this
            long; ``shared_pinned_max_age_s`` for chunks holding a pinned block.
        shared_tenant_budget_mb: collection keeps each tenant within this many MB.
        shared_gc_interval_s: this server collects the tier this often (0: never;
            run ``contextkit shared gc`` instead). One collector per tier is enough.
        shared_warm_share: at start, the DDR tier is warmed from the chunks the
            live replicas lease (what their DDR tiers hold) up to this share of its
            budget, beside serving (0: not warmed).
        chunk_reuse: reuse labelled spans found after a request's prefix hit (chunks:
            moved K/V, seams recomputed with the served model; see docs/chunks.md "On
            vLLM"). Needs ``--load-format contextkit`` and applies to requests that opt
            in (a ``cache_salt`` ending in ``#ck-chunks``). Default off.
        chunk_repair_first: each moved chunk's first tokens recomputed (its seam; none
            where it sat right after the chunk before it where both were computed, or
            after the same ``chunk_seam_lead`` tokens as where it was computed).
        chunk_seam_lead: that many tokens before a moved chunk, the same here as where
            it was computed, spare it its seam (0: only the first case does).
        chunk_repair_ratio: besides those, this share of the moved tokens is recomputed:
            the ones whose K/V at ``chunk_select_layer`` deviate most from the moved
            K/V (CacheBlend's selection; the layers up to it run over every token of
            the range). 0 (default): the seams only.
        chunk_select_layer: the layer of that comparison.
        chunk_min_tokens: spans shorter than this are computed, not reused.
        chunk_max_hops: chunks this many moves from a full computation are computed.
        chunk_layers: comma-separated labels (layers) that may be reused; empty: all.
        chunk_gate_min_agreement: the per-model check at start (chunk reuse against a
            full prefill, teacher-forced) turns chunk reuse on at this top-1 agreement
            or above ...
        chunk_gate_max_kl: ... and this mean KL or below; else it stays off.
        chunk_matmul_dtype: the projections' dtype when the connector computes seams
            and changed spans: ``auto`` (default: bfloat16 on a CPU with bfloat16
            dot products, AMX-BF16 or AVX512-BF16, where they run 2-3x faster at a
            few hundred tokens; else the model's),
            ``model`` or ``bfloat16``. With bfloat16 on AMX, passes of 64 tokens or
            more attend in bfloat16 too (vLLM's AMX kernel over a cast of the
            context). The K/V written stay in the model's dtype; the model check
            above measures the setting.
        recover_strict: ``contextkit serve-vllm`` does not start vLLM when the
            startup recovery reports an error (a session refused, a block skipped, a
            store it cannot read); default: it says so and serves, recomputing what
            was not restored. ``CONTEXTKIT_CONNECTOR_RECOVER_STRICT=1`` or
            ``--strict`` set it; the connector itself ignores it.
    """

    block_size: int = 32
    codec: str = "tq4"
    shadow_url: str = ""
    session_id: str = "vllm"
    local_store: str = dataclasses.field(default_factory=_default_local_store)
    host_blocks: int = 4096
    device_blocks: int = 256
    pin_share: float = 0.5
    device: str | None = None
    shadow_on_save: bool = True
    shadow_interval_s: float = 0.0
    save_threads: int = 1
    stats_path: str = ""
    model_id: str = ""
    endpoint_url: str | None = None
    default_source_layer: str = "user_turn"
    # Typed Any: contextkit.config.loading passes it through as given (a TOML table, a JSON
    # mapping, or an environment variable's text), and __post_init__ checks it.
    precision: Any = dataclasses.field(default_factory=dict, hash=False)
    recover_strict: bool = False
    eviction: str = "semantic"
    store_volatile: str = "room"
    shared_url: str = ""
    shared_endpoint_url: str | None = None
    shared_chunk_blocks: int = 4
    shared_deadline_s: float = 1.0
    shared_max_age_s: float = 24 * 3600.0
    shared_pinned_max_age_s: float = 7 * 24 * 3600.0
    shared_tenant_budget_mb: int = 4096
    shared_gc_interval_s: float = 0.0
    shared_warm_share: float = 0.5
    chunk_reuse: bool = False
    chunk_repair_first: int = 4
    chunk_seam_lead: int = 16
    chunk_repair_ratio: float = 0.0
    chunk_select_layer: int = 1
    chunk_min_tokens: int = 16
    chunk_max_hops: int = 4
    chunk_layers: str = ""
    chunk_gate_min_agreement: float = 0.9
    chunk_gate_max_kl: float = 0.1
    chunk_matmul_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.store_volatile not in STORE_VOLATILE:
            raise ConnectorConfigError(f"store_volatile must be one of "
                                       f"{', '.join(STORE_VOLATILE)}, got "
                                       f"{self.store_volatile!r}")
        if self.eviction not in EVICTION_POLICIES:
            raise ConnectorConfigError(f"eviction must be one of "
                                       f"{', '.join(EVICTION_POLICIES)}, got {self.eviction!r}")
        self._check_numbers()
        if self.codec not in FORMATS:
            raise ConnectorConfigError(f"codec must be one of {', '.join(FORMATS)}, "
                                       f"got {self.codec!r}")
        object.__setattr__(self, "precision", _precision_mapping(self.precision))
        try:
            PrecisionPolicy.from_mapping(self.precision, policy_for_codec(self.codec))
        except PrecisionError as exc:
            raise ConnectorConfigError(str(exc)) from None
        if not 0.0 < self.pin_share <= 1.0:
            raise ConnectorConfigError(f"pin_share must be in (0, 1], got {self.pin_share}")
        if self.shared_url:
            self.shared_tier()  # checks the shared tier's settings
        if not 0.0 <= self.chunk_repair_ratio <= 1.0:
            raise ConnectorConfigError(
                f"chunk_repair_ratio must be in [0, 1], got {self.chunk_repair_ratio}")
        if not 0.0 <= self.chunk_gate_min_agreement <= 1.0 or self.chunk_gate_max_kl < 0:
            raise ConnectorConfigError(
                "chunk_gate_min_agreement must be in [0, 1] and chunk_gate_max_kl >= 0, got "
                f"{self.chunk_gate_min_agreement} and {self.chunk_gate_max_kl}")
        if self.chunk_matmul_dtype not in MATMUL_DTYPES:
            raise ConnectorConfigError(f"chunk_matmul_dtype must be one of "
                                       f"{', '.join(MATMUL_DTYPES)}, got "
                                       f"{self.chunk_matmul_dtype!r}")
        if not 0.0 <= self.shared_warm_share <= 1.0:
            raise ConnectorConfigError(
                f"shared_warm_share must be in [0, 1], got {self.shared_warm_share}")
        for name in ("shadow_url", "local_store", "shared_url"):
            url = getattr(self, name)
            if url and "://" not in url:
                raise ConnectorConfigError(f"{name} must be a URL (file:///path or "
                                           f"s3://bucket/prefix), got {url!r}")

    def _check_numbers(self) -> None:
        """Every duration and size, through the one check (:mod:`contextkit.config.limits`)."""
        err = ConnectorConfigError
        for name in ("shadow_interval_s", "shared_gc_interval_s"):
            seconds(getattr(self, name), name, zero=True, error=err)
        for name in ("shared_deadline_s", "shared_max_age_s", "shared_pinned_max_age_s"):
            seconds(getattr(self, name), name, error=err)
        for name in ("block_size", "host_blocks", "device_blocks", "save_threads",
                     "shared_chunk_blocks", "shared_tenant_budget_mb", "chunk_min_tokens",
                     "chunk_max_hops"):
            size(getattr(self, name), name, minimum=1, error=err)
        size(self.chunk_repair_first, "chunk_repair_first", minimum=0, error=err)
        size(self.chunk_seam_lead, "chunk_seam_lead", minimum=0, error=err)
        size(self.chunk_select_layer, "chunk_select_layer", minimum=0, error=err)

    def shared_tier(self) -> SharedTierConfig:
        """The shared tier's settings (:class:`shadow.shared.SharedTierConfig`).

        Raises:
            ConnectorConfigError: a ``shared_url`` no store serves (``ftp://``), or a
                setting the tier refuses.
        """
        from shadow import ShadowStoreError
        from shadow.shared.tier import SharedTierConfig, SharedTierError
        from shadow.stores import store_class

        try:
            store_class(self.shared_url)
        except ShadowStoreError as exc:
            raise ConnectorConfigError(f"shared_url {self.shared_url!r}: {exc}") from None
        try:
            return SharedTierConfig(
                url=self.shared_url,
                endpoint_url=self.shared_endpoint_url or self.endpoint_url,
                chunk_blocks=self.shared_chunk_blocks, deadline_s=self.shared_deadline_s,
                max_age_s=self.shared_max_age_s,
                pinned_max_age_s=self.shared_pinned_max_age_s,
                tenant_budget_bytes=self.shared_tenant_budget_mb << 20)
        except SharedTierError as exc:
            raise ConnectorConfigError(str(exc).replace("shared tier ", "shared_")) from None

    def shared_tier_key(self) -> bytes:
        """The MAC key the shared tier uses (``$CONTEXTKIT_SHADOW_KEY``). The connector
        takes it from here, and ``serve-vllm`` asks here before vLLM starts.

        Raises:
            ConnectorConfigError: none is set (every replica needs the same one).
        """
        from shadow.auth import KEY_STEP, resolve_key

        key = resolve_key(None)
        if key is None:
            raise ConnectorConfigError(
                f"shared_url {self.shared_url!r} needs the deployment's MAC key, the same on "
                f"every replica: {KEY_STEP} (before serve-vllm starts)")
        return key

    @property
    def pins(self) -> PinConfig:
        """The pin quotas of every pool: ``pin_share`` of its device tier per tenant."""
        from gpu_cache.config import PinConfig  # lazily: this module stays numba-free

        return PinConfig(tenant_share=self.pin_share, total_share=max(0.75, self.pin_share))

    @property
    def chunk_labels(self) -> frozenset[str] | None:
        """The labels chunk reuse may reuse (None: every label)."""
        names = frozenset(n.strip() for n in self.chunk_layers.split(",") if n.strip())
        return names or None

    @property
    def policy(self) -> PrecisionPolicy:
        """The effective precision policy: ``precision`` over ``codec``'s policy."""
        return PrecisionPolicy.from_mapping(self.precision, policy_for_codec(self.codec))

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None, *,
                          env: Mapping[str, str] | None = None) -> ConnectorConfig:
        """Build from ``kv_connector_extra_config`` over contextkit's configuration.

        The ``[connector]`` section of :func:`contextkit.config.load_config` (its file,
        ``CONTEXTKIT_CONNECTOR_*`` variables, ``CONTEXTKIT_CONNECTOR_CONFIG``) gives the
        base; ``extra`` (what ``--kv-transfer-config`` says) wins over it.

        Raises:
            ConnectorConfigError: an unknown key or a bad value, in any source.
        """
        extra = dict(extra or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConnectorConfigError(
                f"unknown kv_connector_extra_config keys {unknown}; known keys: {sorted(known)}")
        try:
            config: ConnectorConfig = load_config(env=env, overrides={"connector": extra})[
                "connector"]
        except ConfigError as exc:
            raise ConnectorConfigError(str(exc)) from None
        return config

    @classmethod
    def from_json(cls, text: str) -> ConnectorConfig:
        """From the extra-config JSON object, or a whole ``--kv-transfer-config`` JSON."""
        return cls.from_extra_config(cls.extra_from_json(text))

    @staticmethod
    def extra_from_json(text: str) -> dict[str, Any]:
        """The extra-config object a JSON text holds: itself, or a whole
        ``--kv-transfer-config``'s ``kv_connector_extra_config``."""
        doc = json_object(text, "connector config", error=ConnectorConfigError)
        if "kv_connector_extra_config" in doc or "kv_connector" in doc:
            doc = doc.get("kv_connector_extra_config") or {}
        return dict(doc)

    def to_extra_config(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _precision_mapping(value: object) -> dict[str, Any]:
    """``precision`` as a plain dict: a mapping, JSON text of one, or None/empty."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ConnectorConfigError(
                f'precision must be a JSON object (e.g. {{"default": "tq4"}}), got '
                f"{value!r}") from None
    if not isinstance(value, Mapping):
        raise ConnectorConfigError(f'precision must be a mapping of policy keys (e.g. '
                                   f'{{"default": "tq4"}}), got {value!r}')
    try:  # a plain, JSON-able copy: to_extra_config must round-trip it
        return json.loads(json.dumps(dict(value)))
    except (TypeError, ValueError) as exc:
        raise ConnectorConfigError(f"precision must hold JSON values only: {exc}") from None


def pin_advice(config: ConnectorConfig, *, tenant: str, needed: int, quota: int,
               pool_ratio: float = 1.0) -> str:
    """One line: a tenant's stable prefix needs ``needed`` pinned blocks of a pool whose
    per-tenant quota is ``quota``; which connector keys to raise, and to what.

    Args:
        config: the connector's configuration (``pin_share``, ``device_blocks``).
        tenant: the tenant whose prefix was left unpinned.
        needed: the pinned blocks the tenant would hold (held plus new).
        quota: the pool's per-tenant quota.
        pool_ratio: the pool's device blocks per ``device_blocks`` (1 for the pool of
            ``codec``; a wider format's pool holds fewer blocks in the same bytes).
    """
    pool_blocks = config.device_blocks * pool_ratio
    blocks = math.ceil(needed / (config.pin_share * pool_ratio))
    share = math.ceil(needed / pool_blocks * 100) / 100
    options = f"device_blocks to {blocks}"
    if config.pin_share < share <= 1.0:
        options = f"pin_share to {share:g} or {options}"
    of = f"device_blocks={config.device_blocks}"
    if pool_ratio != 1.0:
        # a wider format's pool: device_blocks counts blocks of the codec's size
        of = (f"the {math.floor(pool_blocks)} blocks of this pool: {of} are counted in "
              f"blocks of the codec's format, and this pool's blocks are "
              f"{1 / pool_ratio:.2f}x their size")
    return (f"tenant {tenant!r}: pinning its stable prefix needs {needed} device blocks, "
            f"over its quota of {quota} (pin_share={config.pin_share:g} of {of}), so its "
            f"blocks are stored unpinned; raise {options} in kv_connector_extra_config")


def kv_transfer_config(config: ConnectorConfig) -> dict[str, Any]:
    """The ``--kv-transfer-config`` object that loads this connector.

    ``kv_load_failure_policy="recompute"``: a block the store lost between lookup and
    load (evicted, corrupt) is recomputed by vLLM instead of failing the request.
    """
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": config.to_extra_config(),
    }
