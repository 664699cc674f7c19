"""The ``l3.zmq`` options of :class:`.client.ZmqStore`: :class:`ZmqStoreConfig` (pydantic, ``extra="forbid"``),
their defaults (:data:`OPTION_DEFAULTS`) and :func:`check_options`, which validates a section without connecting.

Times are seconds (finite, ``timeout_s`` > 0), sizes bytes; with the page size known, ``max_message_bytes`` and
``shm_bytes`` must hold one page. A bad value raises :class:`~.common.ConfigError` naming ``l3.zmq.<key>``.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from tierkv.storage_backends.common import config_error
from tierkv.storage_backends.zmq import protocol as P

#: bytes kept free in each message for the msgpack header (per-key costs are added on top).
_MSG_SLACK = 64 << 10
#: per-key allowance for the key text, the page header and frame overhead in one message.
_PER_KEY_OVERHEAD = 256

#: allowed values of ``l3.zmq.shm`` (YAML's ``on``/``off`` arrive as booleans and are accepted as such)
SHM_MODES = ("auto", "on", "off")


def shm_mode(v: Any) -> str:
    """``l3.zmq.shm`` as one of :data:`SHM_MODES` (``True``/``False``, as YAML reads ``on``/``off``, map to them)."""
    if v is True:
        return "on"
    if v is False:
        return "off"
    return v


def is_local_endpoint(endpoint: str) -> bool:
    """True for ``ipc://`` and for ``tcp://`` on a loopback address (127.0.0.0/8, ::1, localhost)."""
    if endpoint.startswith("ipc://"):
        return True
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _seconds(v: Any, positive: bool) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"must be a finite number of seconds {'> 0' if positive else '>= 0'}")
    return float(v)


class ZmqStoreConfig(BaseModel):
    """The ``l3.zmq`` section (the keyword arguments of :class:`ZmqStore`). Validated with the page size, when known,
    in the validation context (``context={"page_bytes": n}``): ``shm_bytes`` and ``max_message_bytes`` must then
    hold one page."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str = "tcp://127.0.0.1:5557"
    timeout_s: float = 1.0
    token: Optional[str] = Field(default=None, repr=False)  # a secret: error messages and ``config check`` hide it
    max_message_bytes: int = P.DEFAULT_MAX_MESSAGE_BYTES
    reconnect_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    shm: str = "off"
    shm_bytes: int = 64 << 20

    @field_validator("endpoint", mode="before")
    @classmethod
    def _endpoint(cls, v: Any) -> str:
        if not isinstance(v, str) or not v.startswith(("tcp://", "ipc://")):
            raise ValueError("must look like 'tcp://HOST:PORT' or 'ipc://PATH'")
        return v

    @field_validator("timeout_s", mode="before")
    @classmethod
    def _timeout(cls, v: Any) -> float:
        return _seconds(v, positive=True)

    @field_validator("reconnect_backoff_s", mode="before")
    @classmethod
    def _backoff(cls, v: Any) -> float:
        return _seconds(v, positive=False)

    @field_validator("max_backoff_s", mode="before")
    @classmethod
    def _max_backoff(cls, v: Any, info: ValidationInfo) -> float:
        v = _seconds(v, positive=False)
        first = info.data.get("reconnect_backoff_s")
        if first is not None and v < first:
            raise ValueError(f"must be >= reconnect_backoff_s ({first})")
        return v

    @field_validator("token", mode="before")
    @classmethod
    def _token(cls, v: Any) -> Optional[str]:
        if v is not None and (not isinstance(v, str) or not v):
            raise ValueError("must be a non-empty string or null")
        return v

    @field_validator("shm", mode="before")
    @classmethod
    def _shm(cls, v: Any) -> str:
        v = shm_mode(v)
        if v not in SHM_MODES:
            raise ValueError(f"allowed values are {', '.join(SHM_MODES)}")
        return v

    @field_validator("shm_bytes", mode="before")
    @classmethod
    def _shm_bytes(cls, v: Any, info: ValidationInfo) -> int:
        page_bytes = (info.context or {}).get("page_bytes")
        if type(v) is not int or not (page_bytes or 1) <= v <= P.MAX_SHM_BYTES:
            raise ValueError(f"must be an int of bytes in [{page_bytes or 1} (one page), {P.MAX_SHM_BYTES}]")
        return v

    @field_validator("max_message_bytes", mode="before")
    @classmethod
    def _max_message(cls, v: Any, info: ValidationInfo) -> int:
        page_bytes = (info.context or {}).get("page_bytes")
        need = (page_bytes or 1) + _PER_KEY_OVERHEAD + _MSG_SLACK
        if type(v) is not int or v < need:
            held = f"one page of page_bytes={page_bytes}" if page_bytes else "one page plus 64 KiB"
            raise ValueError(f"must be an int >= {need} to hold {held}")
        return v


#: the keys of ``l3.zmq`` and their defaults
OPTION_DEFAULTS: dict[str, Any] = {k: f.default for k, f in ZmqStoreConfig.model_fields.items()}


def check_options(cfg: dict, page_bytes: Optional[int] = None) -> ZmqStoreConfig:
    """Validate the ``l3.zmq`` section without connecting (the connector checks it at start-up, before any
    backend exists). ``page_bytes`` (bytes of one page), when known, also checks that ``max_message_bytes``
    and ``shm_bytes`` hold one page.

    Raises:
        ConfigError: an unknown key (the allowed ones are listed) or a bad value, naming ``l3.zmq.<key>``.
    """
    try:
        return ZmqStoreConfig.model_validate(cfg, context={"page_bytes": page_bytes})
    except ValidationError as e:
        raise config_error(e, "l3.zmq", ZmqStoreConfig) from None

