"""The configuration room: one configuration for every component, and shared errors.

Owns the section dataclasses contextkit defines (``settings``), how a configuration
is read from defaults, a file, the environment and code (``loading``), and the errors
every room raises for what a user got wrong (``errors``: :class:`ConfigError`, a
missing optional extra). The lowest floor of contextkit: it imports only
:mod:`gpu_cache` and :mod:`shadow` (lazily, to build their objects), never another
room. Sections defined higher up (the tier manager's, the vLLM connector's) register
through the ``contextkit.config_sections`` entry points.
"""

from __future__ import annotations

from contextkit.config.errors import ConfigError, MissingExtraError, require
from contextkit.config.loading import (
    CONFIG_ENV,
    ENV_PREFIX,
    SECTIONS,
    SECTIONS_GROUP,
    Config,
    load_config,
    register_section,
    resolve_config,
    section_classes,
)
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
    "CacheSettings",
    "Config",
    "ConfigError",
    "EngineSettings",
    "MetricsSettings",
    "MissingExtraError",
    "PipelineSettings",
    "ShadowSettings",
    "load_config",
    "register_section",
    "require",
    "resolve_config",
    "section_classes",
]
