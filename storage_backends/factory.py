"""Build the configured L3 store from the ``l3`` section of the tierkv config.

Like SGLang HiCache's ``StorageBackendFactory`` (backends registered by name and imported lazily), but every
backend's keys are validated up front and an error names the key (``l3.file.capacity_bytes``) and what is allowed.

Every backend is one entry of :data:`BACKENDS`: its module, its store class and the pydantic model of its section.
The ``l3`` config model (:data:`L3Config`), :func:`validate_l3`, :func:`build_backend`, the lazy attributes of
``tierkv.storage_backends``, ``tierkv config`` and the engine's start-up line all read that table. A store class takes
``(namespace: bytes, page_bytes: int, **section)`` where ``section`` is its ``l3.<name>`` mapping as given, and raises
``ConfigError`` or ``TypeError`` for bad keys. A backend's module is imported only when its section is used, so a
missing optional dependency only matters to who uses it.
"""
from __future__ import annotations

import importlib
from typing import Any, Literal, NamedTuple, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from tierkv.storage_backends.base import StorageBackend
from tierkv.storage_backends.common import ConfigError, config_error
from tierkv.storage_backends.eviction import SELF_EVICTING, self_evicting_error
from tierkv.storage_backends.faulty import FaultsConfig, FaultyBackend


class Backend(NamedTuple):
    """One L3 backend: everything the factory, the config loader, the CLI and the engine's start-up line need."""

    #: module holding the store class and its config model (imported only when the backend's section is used)
    module: str
    #: the store class: ``cls(namespace, page_bytes, **section)``
    cls: str
    #: the pydantic model of the ``l3.<name>`` section, in ``module``
    config: str
    #: the section key that says where pages go (shown in the engine's start-up line)
    target: str
    #: values for required keys when the section is set but another backend is selected (so a section not in use is
    #: still checked for typos without demanding what only a built store needs)
    placeholders: dict[str, Any] = {}

    def import_module(self, name: str):
        try:
            return importlib.import_module(self.module)
        except ImportError as e:
            raise ConfigError(f"l3.backend '{name}' is not available: cannot import {self.module} ({e})") from e

    def config_model(self, name: str) -> type:
        return getattr(self.import_module(name), self.config)


#: ``l3.backend`` name -> its backend; one entry adds a backend everywhere (config keys, validation, build, CLI)
BACKENDS: dict[str, Backend] = {
    "file": Backend("tierkv.storage_backends.file.store", "FileStore", "FileStoreConfig", "root", {"root": "."}),
    "zmq": Backend("tierkv.storage_backends.zmq.client", "ZmqStore", "ZmqStoreConfig", "endpoint"),
    "mooncake": Backend("tierkv.storage_backends.mooncake.store", "MooncakeStore", "MooncakeStoreConfig", "master_address"),
    "lmcache": Backend("tierkv.storage_backends.lmcache.store", "LMCacheStore", "LMCacheStoreConfig", "endpoint",
                       {"page_tokens": 16}),
    "redis": Backend("tierkv.storage_backends.redis", "RedisStore", "RedisStoreConfig", "url"),
}

#: the values of ``l3.backend``
L3_BACKENDS = ("none", *BACKENDS)

#: the values of ``l3.admission`` (:mod:`tierkv.connector.l3.admission`)
L3_ADMISSIONS = ("always", "second_sight", "reused_in_l2")


class _L3Base(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


L3Config = create_model(
    "L3Config", __base__=_L3Base, __module__=__name__,
    __doc__="""The ``l3`` section of the tierkv config (a field of :class:`tierkv.connector.core.config.TierKVConfig`, which
    re-exports this class). ``backend`` selects one store (one of :data:`L3_BACKENDS`); each backend's keys live under
    the section of its name as plain mappings and are validated by :func:`validate_l3` (at config load) and
    :func:`build_backend`; ``faults`` wraps the store in :class:`~tierkv.storage_backends.faulty.FaultyBackend`.""",
    backend=(Literal[L3_BACKENDS], "none"),
    **{name: (dict[str, Any], Field(default_factory=dict)) for name in BACKENDS},
    faults=(dict[str, Any], Field(default_factory=dict)),
    admission=(Literal[L3_ADMISSIONS], "always"),
    admission_window_pages=(int, Field(1 << 18, gt=0)),
)


def l3_target(l3: Any) -> Optional[str]:
    """Where the selected store keeps pages, as its section says (``root``, ``endpoint``...), or None."""
    if l3.backend == "none":
        return None
    return (getattr(l3, l3.backend) or {}).get(BACKENDS[l3.backend].target)


def _l3(l3_cfg: Union[dict, L3Config, None]) -> L3Config:
    if l3_cfg is None:
        return L3Config()
    if isinstance(l3_cfg, L3Config):
        return l3_cfg
    if not isinstance(l3_cfg, dict):
        raise ConfigError(f"l3 config must be a mapping or L3Config, got {type(l3_cfg).__name__}")
    try:
        return L3Config.model_validate(l3_cfg)
    except ValidationError as e:
        raise config_error(e, "l3") from None


def validate_l3(l3_cfg: Union[dict, L3Config, None]) -> L3Config:
    """Check every key of the ``l3`` section without building a store or touching the network or the disk:
    the backend name, ``l3.faults``, and each backend section that is set (the selected one and any other, so a
    typo in a section not in use is caught too). :func:`tierkv.connector.core.config.load_config` calls this, so a
    bad L3 key stops the engine at start-up like any other key. Returns the validated :class:`L3Config`.

    Raises:
        ConfigError: naming ``l3.<backend>.<key>`` and what is allowed (allowed keys for an unknown key).
    """
    cfg = _l3(l3_cfg)
    if cfg.faults:
        try:
            FaultsConfig.model_validate(cfg.faults)
        except ValidationError as e:
            raise config_error(e, "l3.faults", FaultsConfig) from None
    for name, backend in BACKENDS.items():
        section = getattr(cfg, name)
        if section or cfg.backend == name:
            backend_section(name, section, selected=cfg.backend == name)
    return cfg


def backend_section(name: str, section: dict, selected: bool = True) -> BaseModel:
    """The ``l3.<name>`` section validated by its backend's config model (every default filled in). A section of a
    backend that is not ``selected`` gets the backend's placeholders for keys only a built store needs.

    Raises:
        ConfigError: naming ``l3.<name>.<key>`` and what is allowed, or the backend's module cannot be imported.
    """
    backend = BACKENDS[name]
    _no_policy(name, section)
    model = backend.config_model(name)
    sub = dict(section) if selected else {**backend.placeholders, **section}
    try:
        return model.model_validate(sub)
    except ValidationError as e:
        raise config_error(e, f"l3.{name}", model) from None


def _no_policy(name: str, section: dict) -> None:
    # a store that evicts by itself: an eviction policy here would do nothing, so it stops start-up
    if name in SELF_EVICTING and "eviction_policy" in (section or {}):
        raise ConfigError(self_evicting_error(name))


def build_backend(l3_cfg: Union[dict, L3Config, None], namespace: bytes, page_bytes: int) -> Optional[StorageBackend]:
    """The L3 store selected by ``l3.backend``, or ``None`` for ``none``.

    Args:
        l3_cfg: the ``l3`` section (a dict as in YAML, or a validated :class:`L3Config`):
            ``backend: none|file|zmq|mooncake|lmcache``, the backend's keys under the section of the same name, and an
            optional ``faults`` section (:class:`~tierkv.storage_backends.faulty.FaultsConfig`) that wraps the
            store in :class:`~tierkv.storage_backends.faulty.FaultyBackend`.
        namespace: 16-byte namespace digest (``ModelNamespace.digest()``).
        page_bytes: bytes of one page payload (all layers, K and V).
    Raises:
        ConfigError: an unknown backend or key, a bad value (the message names ``l3.<backend>.<key>``), a backend
            whose module cannot be imported, or a store that cannot start (e.g. an unwritable ``l3.file.root``).
    """
    cfg = _l3(l3_cfg)
    faults: Optional[FaultsConfig] = None
    if cfg.faults:
        try:
            faults = FaultsConfig.model_validate(cfg.faults)
        except ValidationError as e:
            raise config_error(e, "l3.faults", FaultsConfig) from None
    name = cfg.backend
    if name == "none":
        if faults is not None:
            raise ConfigError("l3.faults is set but l3.backend is 'none': faults wrap a store; choose one of "
                              f"{', '.join(BACKENDS)}")
        return None
    backend = BACKENDS[name]
    _no_policy(name, getattr(cfg, name))
    mod = backend.import_module(name)
    try:
        cls = getattr(mod, backend.cls)
    except AttributeError:
        raise ConfigError(f"l3.backend '{name}' is not available: {backend.module} has no {backend.cls}") from None
    try:
        store: StorageBackend = cls(namespace, page_bytes, **getattr(cfg, name))
    except ConfigError:
        raise
    except TypeError as e:
        raise ConfigError(f"invalid tierkv config: bad keys in 'l3.{name}': {e}") from e
    if faults is not None:
        store = FaultyBackend.from_config(store, faults)
    return store
