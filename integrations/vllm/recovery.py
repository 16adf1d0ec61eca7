"""``contextkit recover --for-vllm``: restore shadowed sessions into the connector's store.

The startup job before ``vllm serve`` (see ``scripts/vllm-serve-with-recovery.sh``):

1. derive the connector's cache identity from the model directory and the connector
   config (the same function the connector uses);
2. read every session (or the chosen ones) from the shadow store (``file://`` or
   ``s3://``); a session of another model, tokenizer, block size or schema is
   refused with the differing fields named, and nothing of it is restored; so is
   a session whose block format this contextkit does not know;
3. recover the compatible sessions, grouped by pool identity (block format and key
   offsets: the connector keeps one pool per format), each group into a cache of
   its own, verifying every block's checksums (corrupt blocks are skipped and
   listed; the prefix chain breaks there, so vLLM recomputes from that block on);
4. write the verified blocks as one snapshot session per group into the
   connector's ``local_store`` (``vllm-recovered``, ``vllm-recovered@<format>...``),
   which the connector loads into its DDR tier when vLLM starts (scheduler and
   worker both read them, before the server accepts traffic).

Keeping the remote read and the verification out of vLLM's startup means a slow or
broken shadow store never delays or fails the engine, and the job's exit status
and JSON say what was restored.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from contextkit.cli.status import local_store_path
from contextkit.config.limits import read_bounded
from gpu_cache import CacheConfig, CacheIdentity, CacheIdentityError, TQGPUCache
from gpu_cache.config import NO_PIN_QUOTA
from integrations.vllm.config import ConnectorConfig
from integrations.vllm.identity import check_same_model, vllm_cache_identity
from integrations.vllm.pools import format_summary, session_name, total_summary
from integrations.vllm.snapshots import LOCAL_SESSION
from shadow import (
    CacheShadow,
    Manifest,
    RecoveryReport,
    ShadowConfig,
    ShadowError,
    ShadowStoreError,
    StoreConfig,
    discover_sessions,
    load_manifest,
    open_store,
    recover_session,
)
from shadow.cli import check_store_option
from shadow.debris import LEASE_NAME

__all__ = ["check_model_dir", "leftover_files", "load_connector_config", "missing_shadow",
           "model_identity", "print_summary", "recover_for_vllm", "run_recover_for_vllm"]

_MODEL_HINT = "pass --model DIR, the Hugging Face model directory vLLM serves"

logger = logging.getLogger(__name__)


def recover_for_vllm(model_dir: str, config: ConnectorConfig, *, shadow_url: str | None = None,
                     session_ids: list[str] | None = None,
                     endpoint_url: str | None = None,
                     allow_unauthenticated: bool = False) -> dict[str, Any]:
    """Restore shadowed sessions into ``config.local_store`` for the connector.

    Args:
        model_dir: the Hugging Face directory vLLM will serve.
        config: the connector config (block size, codec, shadow URL, local store).
        shadow_url: overrides ``config.shadow_url``.
        session_ids: sessions to restore (default: every session in the store).
        endpoint_url: S3-compatible endpoint (default: ``config.endpoint_url``).
        allow_unauthenticated: restore unsigned sessions of an ``s3://`` store (refused
            by default; manifests are checked with ``$CONTEXTKIT_SHADOW_KEY``).

    Returns:
        JSON-able summary: sessions restored, blocks, skipped blocks with reasons,
        refused sessions with reasons (``errors``), the local store, and per block
        format ``formats: {fmt: {"blocks", "bytes", "bytes_per_token", "vs_fp16"}}``
        of the snapshot (``bytes_per_token`` and ``vs_fp16`` over all formats too).

    Raises:
        ValueError: no shadow store given, or a model directory whose ``config.json``
            does not describe a model (one line naming the file).
        ShadowStoreError: a ``file://`` shadow that does not exist (yet: the message
            says a server creates it with its first save).
    """
    start = time.perf_counter()
    url = shadow_url or config.shadow_url
    if not url:
        raise ValueError("no shadow store: pass --store URL or set shadow_url in the "
                         "connector config")
    missing = missing_shadow(url)
    if missing is not None:
        raise ShadowStoreError(
            f"no shadow at {missing} yet: nothing to restore. A vLLM server with this "
            "connector config creates it with its first save (`contextkit serve-vllm` "
            "starts without it); if it should exist, check shadow_url in the connector "
            "config")
    identity = model_identity(model_dir, config)
    store = open_store(url, StoreConfig(endpoint_url=endpoint_url or config.endpoint_url),
                       create=False)
    report = RecoveryReport()
    caches: dict[CacheIdentity, TQGPUCache] = {}  # one per pool identity
    try:
        wanted = session_ids or [s.session_id for s in discover_sessions(store)]
        groups: dict[CacheIdentity, list[Manifest]] = {}
        for sid in wanted:
            try:
                manifest = load_manifest(store, sid)
                check_same_model(identity, manifest.identity, what=f"shadow session {sid!r}")
                groups.setdefault(manifest.identity, []).append(manifest)
            except (ShadowError, CacheIdentityError) as exc:
                report.errors[sid] = str(exc)
                logger.warning("session %s refused: %s", sid, exc)
        for ident, manifests in groups.items():
            num_blocks = sum(len(m.blocks) for m in manifests)
            num_pinned = sum(1 for m in manifests for b in m.blocks if b.pinned)
            cache = caches[ident] = TQGPUCache(ident, CacheConfig(
                pins=NO_PIN_QUOTA, num_device_blocks=max(16, num_pinned + 16),
                num_host_blocks=max(16, num_blocks), device="cpu"),
                key_offsets=manifests[0].key_offsets_tensor())
            for manifest in manifests:
                sid = manifest.session_id
                try:
                    report.merge(recover_session(store, sid, cache,
                                                 allow_unauthenticated=allow_unauthenticated))
                except (ShadowError, CacheIdentityError) as exc:
                    report.errors[sid] = str(exc)
    finally:
        store.close()

    local = open_store(config.local_store)
    written = 0
    try:
        # The snapshot is rebuilt from scratch: never leave a stale or foreign one.
        local.delete_many(local.list(LOCAL_SESSION))
        for ident, cache in caches.items():
            if not len(cache.metadata):
                continue
            name = session_name(LOCAL_SESSION, identity, ident)
            with CacheShadow(cache, local, name, config=ShadowConfig(autostart=False)) as snap:
                written += snap.shadow_now().num_blocks
    finally:
        local.close()
    report.seconds = time.perf_counter() - start
    summary = report.to_dict()
    formats = format_summary(identity, [(ident, len(cache.metadata))
                                        for ident, cache in caches.items() if len(cache.metadata)])
    totals = total_summary(identity, formats)
    summary.update(store=url, local_store=config.local_store, snapshot_blocks=written,
                   identity=identity.to_dict(), formats=formats,
                   bytes_per_token=totals["bytes_per_token"], vs_fp16=totals["vs_fp16"])
    return summary


def check_model_dir(model_dir: str | None, *, hint: str = _MODEL_HINT) -> Path:
    """The model directory, if it is one vLLM could serve (it holds ``config.json``).

    ``hint``: how the caller's user names the directory (``recover --for-vllm`` takes
    ``--model DIR``; ``serve-vllm`` a positional ``MODEL``).

    Raises:
        FileNotFoundError: no directory given, a path that does not exist or is not a
            directory, or no ``config.json`` in it; the message says what to pass.
    """
    if not model_dir:
        raise FileNotFoundError(f"--for-vllm needs --model DIR; {hint}")
    path = Path(model_dir).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model directory {path} does not exist; {hint}")
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is a file, not a model directory; {hint}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json; {hint} "
                                "(with config.json, tokenizer and *.safetensors)")
    return path


def model_identity(model_dir: str, config: ConnectorConfig) -> CacheIdentity:
    """The connector's identity for ``model_dir``; a malformed config.json is one line."""
    where = Path(model_dir) / "config.json"
    try:
        return vllm_cache_identity(model_dir, config.block_size, config.codec,
                                   model_id=config.model_id)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON ({exc}); {_MODEL_HINT}") from None
    except KeyError as exc:
        raise ValueError(f"{where} misses {exc.args[0]!r}, needed for the KV shape; "
                         f"{_MODEL_HINT}") from None
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        if isinstance(exc, CacheIdentityError):
            raise
        raise ValueError(f"{where} does not describe the model's KV shape ({exc}); "
                         f"{_MODEL_HINT}") from None


def load_connector_config(text: str | None) -> ConnectorConfig:
    """``--connector-config``: JSON, or ``@FILE`` holding it, over the environment's
    ``CONTEXTKIT_CONNECTOR_*`` (see :meth:`ConnectorConfig.from_extra_config`).

    Raises:
        ConnectorConfigError: an unknown key or variable, or a bad value (one line).
        FileNotFoundError, ValueError: an ``@FILE`` that cannot be read.
    """
    return ConnectorConfig.from_json(_connector_text(text))


def connector_sources(text: str | None) -> list[tuple[str, Any, str]]:
    """``(key, value, source)`` of every connector setting ``load_connector_config(text)``
    gives: ``default``, the file, a variable, or ``--connector-config`` (secrets masked).
    Raises as :func:`load_connector_config` does."""
    from contextkit.config import load_config

    doc = ConnectorConfig.extra_from_json(_connector_text(text))
    ConnectorConfig.from_extra_config(doc)  # its errors, as the connector gives them
    rows = load_config(overrides={"connector": doc}).items()
    return [(key, value, "--connector-config" if source == "code" else source)
            for key, value, source in rows if key.startswith("connector.")]


def _connector_text(text: str | None) -> str:
    text = text or "{}"
    if not text.startswith("@"):
        return text
    path = Path(text[1:]).expanduser()
    try:
        return read_bounded(path, "connector config file")
    except FileNotFoundError:
        raise FileNotFoundError(f"connector config file {path} does not exist; pass "
                                "--connector-config JSON or @FILE") from None
    except OSError as exc:
        raise ValueError(f"cannot read connector config file {path} ({exc}); pass "
                         "--connector-config JSON or @FILE") from None


def run_recover_for_vllm(args: argparse.Namespace) -> dict[str, Any]:
    """The CLI body of ``contextkit recover --for-vllm`` (prints a one-line summary).

    Raises:
        FileNotFoundError, ValueError: a missing or unusable model directory, store or
            connector config; ``contextkit`` prints the one-line message.
    """
    check_store_option(args.store)
    model_dir = check_model_dir(args.model)
    config = load_connector_config(args.connector_config)
    summary = recover_for_vllm(str(model_dir), config, shadow_url=args.store,
                               session_ids=args.session, endpoint_url=args.endpoint_url,
                               allow_unauthenticated=bool(getattr(args, "allow_unauthenticated",
                                                                  False)))
    print_summary(summary, sys.stdout)
    return summary


def print_summary(summary: dict[str, Any], out: TextIO) -> None:
    """The job's summary as lines: totals, each format, each refused session, the first
    ten skipped blocks."""
    out.write(f"recovered {summary['sessions']} session(s) for vLLM from {summary['store']} "
              f"into {summary['local_store']}: {summary['snapshot_blocks']} blocks, "
              f"{summary['skipped']} skipped, {len(summary['errors'])} refused, "
              f"{summary['seconds']:.2f} s\n")
    for fmt, row in summary["formats"].items():
        out.write(f"  {fmt}: {row['blocks']} blocks, {row['bytes_per_token']:.0f} bytes/token "
                  f"({row['vs_fp16']:.3f} of fp16)\n")
    for sid, why in summary["errors"].items():
        out.write(f"  {sid}: {why}\n")
    for skip in summary["skipped_blocks"][:10]:
        out.write(f"  skipped block {skip['index']} of {skip['session_id']}: {skip['reason']}\n")
    out.flush()


def missing_shadow(url: str) -> Path | None:
    """The directory of a ``file://`` shadow that does not exist yet (a first start:
    the connector creates it with its first save); None for one that exists or S3."""
    path = local_store_path(url)
    return path if path is not None and not path.is_dir() else None


def leftover_files(config: ConnectorConfig) -> list[Path]:
    """Writer leases and unfinished temp files in this server's sessions of a ``file://``
    shadow (``session_id`` and its ``session_id@<format>`` pools): what a vLLM that was
    killed before its connector closed leaves behind. Empty for S3."""
    root = local_store_path(config.shadow_url) if config.shadow_url else None
    if root is None or not root.is_dir():
        return []
    sid = config.session_id
    found: list[Path] = []
    for session in sorted(root.iterdir()):
        if session.is_dir() and (session.name == sid or session.name.startswith(sid + "@")):
            found += [p for p in sorted(session.rglob("*"))
                      if p.name == LEASE_NAME or ".tmp-" in p.name]
    return found
