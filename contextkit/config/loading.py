"""One configuration for every component: defaults in one place, four sources, one order.

A configuration is a set of *sections*, each a frozen dataclass whose field defaults are
the defaults (there is no second copy of them anywhere)::

    cache     CacheSettings         sizes and placement of the block cache, cache dir
    engine    EngineSettings        the embedded engine (model, KV format, overlays)
    pins      gpu_cache.PinConfig   per-tenant pin quota, global cap, idle TTL
    pipeline  PipelineSettings      the cache-aware pipeline (tenant, ordering, pinning)
    shadow    ShadowSettings        cold-tier store URL, MAC key, schedule, S3 endpoint
    tiers     TierManagerConfig     the OODA tier manager (``tiers.thresholds.promote``...)
    metrics   MetricsSettings       Prometheus export
    connector ConnectorConfig       the vLLM connector (``kv_connector_extra_config``)

Values come from, lowest precedence first:

1. the defaults of the section dataclasses;
2. a TOML, YAML (the ``yaml`` extra) or JSON file (``--config PATH`` or
   ``$CONTEXTKIT_CONFIG``), one table per section (``[shadow]`` ``url = "file:///var/lib/contextkit"``);
3. environment variables ``CONTEXTKIT_<SECTION>_<FIELD>`` (``CONTEXTKIT_SHADOW_URL``,
   ``CONTEXTKIT_PINS_TENANT_SHARE``; nested fields join with ``__``:
   ``CONTEXTKIT_TIERS_THRESHOLDS__PROMOTE``);
4. code: the ``overrides`` mapping given to :func:`load_config`.

A later source wins field by field. Unknown sections and keys are refused with the known
ones listed, values are converted to the field's type and range-checked at load: every
number must be finite, every duration (a field named ``*_s`` or ``*_seconds``) ``>= 0``,
every string valid UTF-8; then the section's own validation runs. Every error is one
line that names the key and the source of its value.
:meth:`Config.describe` (``contextkit config show``) tells where each value came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib
import json
import math
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from contextkit.config.errors import ConfigError
from contextkit.config.limits import json_object
from contextkit.config.settings import (
    CacheSettings,
    EngineSettings,
    MetricsSettings,
    PipelineSettings,
    ShadowSettings,
)

__all__ = [
    "CONFIG_ENV",
    "ENV_PREFIX",
    "SECTIONS",
    "SECTIONS_GROUP",
    "Config",
    "load_config",
    "register_section",
    "resolve_config",
    "section_classes",
]

#: Environment variable naming the configuration file.
CONFIG_ENV = "CONTEXTKIT_CONFIG"
#: Prefix of every configuration environment variable.
ENV_PREFIX = "CONTEXTKIT_"
#: Fields whose values are never printed.
SECRET_FIELDS = frozenset({"shadow.key"})


#: Entry-point group through which the rooms above the configuration (and other
#: distributions) contribute sections: ``name = "module:Class"`` (pyproject.toml's
#: ``[project.entry-points."contextkit.config_sections"]``). contextkit's own ``tiers``
#: (the loop's tier manager) and ``connector`` (integrations' vLLM connector) come this
#: way, so this module names nothing above it and stays cheap to import (no torch).
SECTIONS_GROUP = "contextkit.config_sections"

#: Section name -> dataclass, or ``"module:Class"`` imported when a configuration is
#: loaded. The sections defined here and below; the others come from
#: :data:`SECTIONS_GROUP`'s entry points (see :func:`section_classes`).
SECTIONS: dict[str, type | str] = {
    "cache": CacheSettings,
    "engine": EngineSettings,
    "pins": "gpu_cache.config:PinConfig",
    "pipeline": PipelineSettings,
    "shadow": ShadowSettings,
    "metrics": MetricsSettings,
}


def register_section(name: str, cls: type | str) -> None:
    """Add a section (a dataclass with defaults for every field, or ``"module:Class"``)."""
    if "_" in name or not name.isidentifier():
        raise ValueError(f"section name {name!r} must be an identifier without '_'")
    SECTIONS[name] = cls


def _entry_point_sections() -> dict[str, str]:
    found = metadata.entry_points(group=SECTIONS_GROUP)
    return {ep.name: ep.value for ep in sorted(found, key=lambda ep: ep.name)}


def section_classes() -> dict[str, type]:
    """Every known section's dataclass: :data:`SECTIONS`, then the entry points'.

    Raises:
        ConfigError: a section's class cannot be imported (a broken install: reinstall
            contextkit, ``pip install -e .`` in a checkout).
    """
    refs: dict[str, type | str] = dict(SECTIONS)
    for name, value in _entry_point_sections().items():
        refs.setdefault(name, value)
    classes = {}
    for name, ref in refs.items():
        if isinstance(ref, str):
            module, _, attr = ref.partition(":")
            try:
                ref = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as exc:
                raise ConfigError(
                    f"configuration section {name!r} ({module}:{attr}) cannot be loaded: "
                    f"{exc}; reinstall contextkit (pip install -e . in a checkout)") from None
        assert isinstance(ref, type) and dataclasses.is_dataclass(ref), name
        classes[name] = ref
    return classes


# --------------------------------------------------------------------------- values
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(cls: type) -> dict[str, Any]:
    hints = _hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, where: str, from_text: bool) -> Any:
    """``value`` as type ``tp``; ``from_text``: it came from an environment variable."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and (value is None or (
                from_text and str(value).strip().lower() in ("", "none", "null"))):
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where, from_text)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp in (int, float):
        if isinstance(value, bool) or (not from_text and not isinstance(value, (int, float))):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            number = tp(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}") from None
        if isinstance(number, float) and not math.isfinite(number):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        if tp is int and isinstance(value, float) and number != value:
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        try:
            value.encode()
        except UnicodeEncodeError:  # lone surrogates: non-UTF-8 bytes in the environment
            raise ConfigError(f"{where}: not valid UTF-8 text; set it to UTF-8 text") from None
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        for member in tp:
            if value in (member.value, member.name) or str(value).lower() in (
                    str(member.value).lower(), member.name.lower()):
                return member
        raise ConfigError(f"{where}: expected one of {[m.name.lower() for m in tp]}, "
                          f"got {value!r}")
    if tp is Any:
        return value
    raise ConfigError(f"{where}: values of type {tp} cannot be configured")


#: Durations by naming convention: ``interval_s``, ``idle_ttl_s``, ``interval_seconds``.
_DURATION = re.compile(r".+_(s|seconds)")


def _check_range(name: str, value: Any, where: str) -> Any:
    """The range every section shares: a duration is never negative (NaN and infinities
    are refused for every number by :func:`_coerce`)."""
    if _DURATION.fullmatch(name) and isinstance(value, (int, float)) \
            and not isinstance(value, bool) and value < 0:
        raise ConfigError(f"{where}: a duration must be >= 0 seconds, got {value!r}")
    return value


def _build(cls: type, values: Mapping[str, Any], where: str,
           sources: Mapping[str, str] | None = None) -> Any:
    kwargs: dict[str, Any] = {}
    fields = _fields(cls)
    for name, value in values.items():
        tp = fields[name]
        kwargs[name] = (_build(tp, value, f"{where}.{name}", sources)
                        if _is_dataclass_type(tp) else value)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        # name the source of every value the message is about (a section's own check
        # knows its field, not where the value came from)
        named = [f"{where}.{name} from {sources[f'{where}.{name}']}" for name in fields
                 if sources and f"{where}.{name}" in sources
                 and re.search(rf"\b{re.escape(name)}\b", str(exc))]
        origin = f" ({'; '.join(named)})" if named else ""
        raise ConfigError(f"{where}: {exc}{origin}") from None


# --------------------------------------------------------------------------- sources
@dataclass(frozen=True, slots=True)
class Config:
    """The effective configuration: one instance per section, and each value's source.

    Sections are attributes (``config.shadow.url``) and items (``config["shadow"]``).
    ``sources`` maps ``"section.field"`` to ``"default"``, ``"file PATH"``,
    ``"env NAME"`` or ``"code"``.
    """

    sections: Mapping[str, Any]
    sources: Mapping[str, str]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.sections[name]
        except KeyError:
            raise AttributeError(f"no configuration section {name!r}; sections: "
                                 f"{sorted(self.sections)}") from None

    def __getitem__(self, name: str) -> Any:
        return self.sections[name]

    def items(self) -> list[tuple[str, Any, str]]:
        """``(key, value, source)`` of every field, sections in order, secrets masked."""
        rows = []
        for section, obj in self.sections.items():
            for key, value in _flatten(obj, section):
                shown = "***" if key in SECRET_FIELDS and value is not None else value
                rows.append((key, shown, self.sources.get(key, "default")))
        return rows

    def describe(self) -> str:
        """One line per field: ``key = value  (source)``."""
        rows = self.items()
        width = max(len(k) for k, _, _ in rows)
        return "\n".join(f"{k:<{width}} = {json.dumps(_plain(v))}  ({s})" for k, v, s in rows)

    def as_dict(self) -> dict[str, Any]:
        """Nested plain values (secrets masked), e.g. for ``--json``."""
        out: dict[str, Any] = {}
        for key, value, source in self.items():
            out[key] = {"value": _plain(value), "source": source}
        return out

    def with_overrides(self, overrides: Mapping[str, Mapping[str, Any]] | None) -> Config:
        """This configuration with ``{section: {field: value}}`` set in code on top.

        Checked exactly as :func:`load_config` checks its ``overrides`` (the same errors);
        the values set here are sourced ``"code"``.
        """
        if not overrides:
            return self
        sources = dict(self.sources)
        sections = dict(self.sections)
        for section, values in overrides.items():
            if section not in sections:
                raise ConfigError(f"unknown configuration section {section!r} (code); "
                                  f"sections: {sorted(sections)}")
            obj = sections[section]
            raw = _raw(obj)
            _merge(raw, type(obj), values, section, "code", sources, False)
            sections[section] = _build(type(obj), raw, section, sources)
        return Config(sections=sections, sources=sources)


def _raw(obj: Any) -> dict[str, Any]:
    """The init fields of a section as a mapping ``_merge`` and ``_build`` take."""
    return {f.name: (_raw(v) if dataclasses.is_dataclass(v := getattr(obj, f.name)) else v)
            for f in dataclasses.fields(obj) if f.init}


def _plain(value: Any) -> Any:
    return value.name.lower() if isinstance(value, enum.Enum) else value


def _flatten(obj: Any, prefix: str) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            rows.extend(_flatten(value, f"{prefix}.{f.name}"))
        else:
            rows.append((f"{prefix}.{f.name}", value))
    return rows


def _merge(into: dict[str, Any], cls: type, values: Any, where: str, source: str,
           sources: dict[str, str], from_text: bool) -> None:
    """Check ``values`` (a mapping for dataclass ``cls``) and merge them into ``into``."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where}: expected a table of keys, got {values!r}")
    fields = _fields(cls)
    for name, value in values.items():
        key = f"{where}.{name}"
        if name not in fields:
            raise ConfigError(f"unknown key {key!r} ({source}); known keys of "
                              f"[{where}]: {sorted(fields)}")
        tp = fields[name]
        if _is_dataclass_type(tp):
            nested = into.setdefault(name, {})
            _merge(nested, tp, value, key, source, sources, from_text)
        else:
            at = f"{key} ({source})"
            into[name] = _check_range(name, _coerce(value, tp, at, from_text), at)
            sources[key] = source


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"configuration file {str(path)!r} does not exist; fix --config or "
                          f"${CONFIG_ENV}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"configuration file {str(path)!r} is not UTF-8 text (byte "
                          f"{exc.start}); save it as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"cannot read configuration file {str(path)!r} "
                          f"({exc.strerror or exc}); fix --config or ${CONFIG_ENV}") from None
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ModuleNotFoundError:
            raise ConfigError(f"configuration file {str(path)!r} is YAML, which needs PyYAML: "
                              f"pip install 'contextkit[yaml]', or use TOML") from None
    try:
        if suffix in (".yaml", ".yml"):
            doc = yaml.safe_load(text)
        elif suffix == ".json":
            doc = json.loads(text)
        else:
            doc = tomllib.loads(text)
    except Exception as exc:  # every parser has its own error class
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"cannot parse configuration file {str(path)!r}: {reason}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"configuration file {str(path)!r} must hold tables of keys")
    return doc


def _env_values(env: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Environment variables as ``{section: {field or nested: text}}`` plus their names."""
    out: dict[str, dict[str, Any]] = {}
    whole: dict[str, Any] = {}
    known = {*SECTIONS, *_entry_point_sections()}  # one scan of the entry points
    for name, text in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or name == CONFIG_ENV:
            continue
        rest = name[len(ENV_PREFIX):].lower()
        section, _, field = rest.partition("_")
        if section not in known:
            raise ConfigError(f"unknown configuration variable ${name}; variables are "
                              f"{ENV_PREFIX}<SECTION>_<FIELD> with sections {sorted(known)}")
        if section == "connector" and field == "config":
            # The connector's historical JSON form: a whole section in one variable.
            doc = json_object(text, f"${name}", error=ConfigError)
            doc = doc.get("kv_connector_extra_config", doc) or {}
            whole.update({k: (v, name, False) for k, v in doc.items()})
            continue
        target = out.setdefault(section, {})
        parts = field.split("__")
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        target[parts[-1]] = (text, name, True)
    # The documented order: per-key variables, then the JSON of the whole section, each
    # later source winning (sorted names would let CONTEXTKIT_CONNECTOR_SHADOW_URL beat
    # the JSON's shadow_url).
    if whole:
        out.setdefault("connector", {}).update(whole)
    return out


def _merge_env(into: dict[str, Any], cls: type, values: dict[str, Any], where: str,
               sources: dict[str, str]) -> None:
    fields = _fields(cls)
    for name, item in values.items():
        key = f"{where}.{name}"
        if name not in fields:
            var = item[1] if isinstance(item, tuple) else key
            near = difflib.get_close_matches(name, list(fields), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            what = ("unknown key" if isinstance(item, tuple) and not item[2]
                    else "unknown configuration variable for")
            raise ConfigError(f"{what} {key!r} (${var}){hint}; known keys of [{where}]: "
                              f"{sorted(fields)}")
        tp = fields[name]
        if _is_dataclass_type(tp):
            if isinstance(item, tuple):
                raise ConfigError(f"${item[1]}: {key} is a table; set its keys with __")
            _merge_env(into.setdefault(name, {}), tp, item, key, sources)
        else:
            text, var, from_text = item
            at = f"{key} (${var})"
            into[name] = _check_range(name, _coerce(text, tp, at, from_text), at)
            sources[key] = f"env {var}"


def load_config(path: str | os.PathLike[str] | None = None, *,
                env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Config:
    """The effective configuration from defaults, a file, the environment and code.

    Args:
        path: a TOML, YAML or JSON file; ``None``: ``$CONTEXTKIT_CONFIG`` if set.
        env: the environment to read (default ``os.environ``).
        overrides: ``{section: {field: value}}`` set in code; they win over the rest.

    Raises:
        ConfigError: an unknown section or key, a value of the wrong type or range, or a
            file that is missing or does not parse. One line, naming the source.
    """
    env = os.environ if env is None else env
    if path is None and env.get(CONFIG_ENV):
        path = env[CONFIG_ENV]
    classes = section_classes()
    raw: dict[str, dict[str, Any]] = {name: {} for name in classes}
    sources: dict[str, str] = {}

    def merge_tables(doc: Mapping[str, Any], source: str, from_text: bool) -> None:
        for section, values in doc.items():
            if section not in classes:
                raise ConfigError(f"unknown configuration section {section!r} ({source}); "
                                  f"sections: {sorted(classes)}")
            _merge(raw[section], classes[section], values, section, source, sources,
                   from_text)

    if path is not None:
        merge_tables(_read_file(Path(path)), f"file {path}", False)
    for section, values in _env_values(env).items():
        _merge_env(raw[section], classes[section], values, section, sources)
    if overrides:
        merge_tables(overrides, "code", False)
    sections = {name: _build(cls, raw[name], name, sources) for name, cls in classes.items()}
    return Config(sections=sections, sources=sources)


def resolve_config(config: Config | str | os.PathLike[str] | None = None,
                   overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Config:
    """The configuration a ``from_config`` constructor was handed, as a :class:`Config`.

    Args:
        config: a loaded :class:`Config`; a TOML, YAML or JSON file (read with the
            environment, as :func:`load_config` does); or ``None``:
            :func:`load_config` (``$CONTEXTKIT_CONFIG``, then ``CONTEXTKIT_*``).
        overrides: ``{section: {field: value}}`` set in code; they win over the rest.

    Raises:
        ConfigError: as :func:`load_config`, or ``config`` of another type.
    """
    if isinstance(config, Config):
        return config.with_overrides(overrides)
    if config is None or isinstance(config, (str, os.PathLike)):
        return load_config(config, overrides=overrides)
    raise ConfigError(f"config must be a contextkit.config.Config, a file path or None, got "
                      f"{type(config).__name__}; build one with contextkit.config.load_config()")
