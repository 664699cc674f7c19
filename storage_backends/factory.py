"""Build the configured L3 store from the ``l3`` section of the tierkv config.

Like SGLang HiCache's ``StorageBackendFactory`` (backends registered by name and imported lazily), but every
backend's keys are validated up front and an error names the key (``l3.file.capacity_bytes``) and what is allowed.

Convention for the networked backends: ``ZmqStore`` (``tierkv.storage_backends.zmq_client``) and ``MooncakeStore``
(``tierkv.storage_backends.mooncake``) and ``LMCacheStore`` (``tierkv.storage_backends.lmcache``) take
``(namespace: bytes, page_bytes: int, **cfg)`` where ``cfg`` is their
sub-section (``l3.zmq`` / ``l3.mooncake`` / ``l3.lmcache``) as given, and raise ``ConfigError`` or ``TypeError`` for bad keys.
They are imported only when selected, so a missing optional dependency only matters to who uses it.
"""
from __future__ import annotations

import importlib
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tierkv.storage_backends.base import StorageBackend
from tierkv.storage_backends.common import ConfigError, config_error
from tierkv.storage_backends.faulty import FaultsConfig, FaultyBackend
from tierkv.storage_backends.file import FileStore, FileStoreConfig

#: the values of ``l3.backend``
L3_BACKENDS = ("none", "file", "zmq", "mooncake", "lmcache")

#: backend name -> (module, class) for the lazily imported networked backends
LAZY_BACKENDS = {
    "zmq": ("tierkv.storage_backends.zmq_client", "ZmqStore"),
    "mooncake": ("tierkv.storage_backends.mooncake", "MooncakeStore"),
    "lmcache": ("tierkv.storage_backends.lmcache", "LMCacheStore"),
}


class L3Config(BaseModel):
    """The ``l3`` section of the tierkv config (a field of :class:`tierkv.connector.config.TierKVConfig`, which
    re-exports this class). ``backend`` selects one store; its own keys live under the section of the same name as
    plain mappings and are validated by :func:`validate_l3` (at config load) and :func:`build_backend`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    backend: Literal["none", "file", "zmq", "mooncake", "lmcache"] = "none"
    file: dict[str, Any] = Field(default_factory=dict)
    zmq: dict[str, Any] = Field(default_factory=dict)
    mooncake: dict[str, Any] = Field(default_factory=dict)
    lmcache: dict[str, Any] = Field(default_factory=dict)
    faults: dict[str, Any] = Field(default_factory=dict)


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
    typo in a section not in use is caught too). :func:`tierkv.connector.config.load_config` calls this, so a
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
    if cfg.file or cfg.backend == "file":
        sub = dict(cfg.file)
        if cfg.backend != "file":  # root is required only when the file store is the one built
            sub.setdefault("root", ".")
        try:
            FileStoreConfig.model_validate(sub)
        except ValidationError as e:
            raise config_error(e, "l3.file", FileStoreConfig) from None
    if cfg.zmq or cfg.backend == "zmq":
        from tierkv.storage_backends.zmq_client import check_options  # pyzmq: only when the section is used

        check_options(dict(cfg.zmq))
    if cfg.mooncake or cfg.backend == "mooncake":
        from tierkv.storage_backends.mooncake import MooncakeStoreConfig  # the wheel itself is imported later

        try:
            MooncakeStoreConfig.model_validate(dict(cfg.mooncake))
        except ValidationError as e:
            raise config_error(e, "l3.mooncake", MooncakeStoreConfig) from None
    if cfg.lmcache or cfg.backend == "lmcache":
        from tierkv.storage_backends.lmcache import check_options as check_lmcache  # pyzmq, msgpack only

        sub = dict(cfg.lmcache)
        if cfg.backend != "lmcache":  # page_tokens is required only when the lmcache store is the one built
            sub.setdefault("page_tokens", 16)
        check_lmcache(sub)
    return cfg


def _lazy_class(name: str) -> type:
    mod_name, cls_name = LAZY_BACKENDS[name]
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"l3.backend '{name}' is not available: cannot import {mod_name} ({e})") from e
    try:
        return getattr(mod, cls_name)
    except AttributeError:
        raise ConfigError(f"l3.backend '{name}' is not available: {mod_name} has no {cls_name}") from None


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
                              "file, zmq, mooncake, lmcache")
        return None
    sub: dict[str, Any] = dict(getattr(cfg, name))
    if name == "file":
        store: StorageBackend = FileStore(namespace, page_bytes, **sub)
    else:
        cls = _lazy_class(name)
        try:
            store = cls(namespace, page_bytes, **sub)
        except ConfigError:
            raise
        except TypeError as e:
            raise ConfigError(f"invalid tierkv config: bad keys in 'l3.{name}': {e}") from e
    if faults is not None:
        store = FaultyBackend.from_config(store, faults)
    return store
