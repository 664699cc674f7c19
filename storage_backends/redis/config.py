"""The ``l3.redis`` section: where the Redis / Valkey server or cluster is and how to reach it.

Validated without touching the network (``tierkv config check``, engine start-up); every error names
``l3.redis.<key>`` and what is allowed. Secrets (``password``) never appear in messages or ``repr``.
Connecting is :mod:`.connect`'s job; the page format and the key names are :mod:`.store`'s.
"""
from __future__ import annotations

import math
import re
from typing import Literal, Optional
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from tierkv.storage_backends.common import ConfigError, config_error

#: URL schemes of ``l3.redis.url``: plain TCP, TCP with TLS, a Unix socket
URL_SCHEMES = ("redis", "rediss", "unix")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_NODE_RE = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")


def parse_node(v: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``. Raises ValueError."""
    m = _NODE_RE.match(v) if isinstance(v, str) else None
    if not m or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"{v!r} is not 'HOST:PORT'")
    return m.group(1).strip("[]"), int(m.group(2))


class RedisStoreConfig(BaseModel):
    """The ``l3.redis`` section (the keyword arguments of :class:`~tierkv.storage_backends.redis.RedisStore`)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["standalone", "cluster"] = Field(
        default="standalone", description="standalone: one server at url; cluster: a Redis Cluster reached through "
        "the seed nodes")
    url: str = Field(default="redis://127.0.0.1:6379/0", description="redis://HOST:PORT/DB, rediss://HOST:PORT/DB "
                     "(TLS) or unix:///path/to/socket, without credentials (standalone mode)")
    nodes: list[str] = Field(default_factory=list, description="cluster mode: seed nodes ['HOST:PORT', ...], any of "
                             "the cluster's nodes (the rest are discovered)")
    username: Optional[str] = Field(default=None, description="ACL user for AUTH; null: the default user")
    password: Optional[str] = Field(default=None, repr=False, description="AUTH password (a secret: never shown); "
                                    "null: no AUTH")
    tls: bool = Field(default=False, description="TLS to the server (also on for a rediss:// url)")
    tls_ca_file: Optional[str] = Field(default=None, description="CA bundle (PEM) that signed the server's "
                                       "certificate; null: the system's")
    tls_cert_file: Optional[str] = Field(default=None, description="client certificate (PEM) for mutual TLS; with "
                                         "tls_key_file")
    tls_key_file: Optional[str] = Field(default=None, description="client key (PEM) for mutual TLS; with "
                                        "tls_cert_file")
    tls_check_hostname: bool = Field(default=True, description="check that the server's certificate names its host")
    key_prefix: str = Field(default="tierkv", description="first part of every key: "
                            "<key_prefix>:<namespace hex>:<page key> (1-64 of A-Z a-z 0-9 _ . -)")
    ttl_s: Optional[float] = Field(default=None, description="seconds a stored page lives (SET ... PX); null: until "
                                   "the server evicts it")
    pool_size: int = Field(default=8, ge=1, le=1024, description="connections per server (cluster: per node), 1..1024; "
                           "calls wait up to timeout_s for a free one")
    timeout_s: float = Field(default=2.0, description="bound of one call's network wait (connect, send, reply), > 0")
    reconnect_backoff_s: float = Field(default=0.05, description="after a failed call, calls are misses without I/O "
                                       "for this long (doubling per failure up to max_backoff_s)")
    max_backoff_s: float = Field(default=2.0, description="longest back-off after consecutive failures")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        try:
            u = urlsplit(v)
            port = u.port
        except ValueError as e:
            raise ValueError(f"not a URL ({e})") from None
        if u.scheme not in URL_SCHEMES:
            raise ValueError(f"scheme must be one of {', '.join(s + '://' for s in URL_SCHEMES)}")
        if u.username or u.password:
            raise ValueError("must not hold credentials: use l3.redis.username / l3.redis.password")
        if u.scheme == "unix":
            if not u.path:
                raise ValueError("a unix:// url needs a socket path")
            return v
        if not u.hostname:
            raise ValueError("needs a host: 'redis://HOST:PORT/DB'")
        if port is not None and not 0 < port < 65536:
            raise ValueError("port must be 1..65535")
        db = u.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(f"database {db!r} is not a number")
        return v

    @field_validator("nodes")
    @classmethod
    def _nodes(cls, v: list[str]) -> list[str]:
        for n in v:
            parse_node(n)
        return v

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not _PREFIX_RE.match(v):
            raise ValueError("must be 1-64 characters of A-Z a-z 0-9 _ . -")
        return v

    @field_validator("ttl_s")
    @classmethod
    def _ttl(cls, v: Optional[float]) -> Optional[float]:
        if v is not None and not (math.isfinite(v) and v >= 0.001):
            raise ValueError("must be null or a finite number of seconds >= 0.001")
        return v

    @field_validator("timeout_s", "reconnect_backoff_s", "max_backoff_s")
    @classmethod
    def _seconds(cls, v: float, info: ValidationInfo) -> float:
        if not math.isfinite(v) or v < 0 or (v == 0 and info.field_name == "timeout_s"):
            raise ValueError("must be a finite number of seconds" + (" > 0" if info.field_name == "timeout_s"
                                                                      else " >= 0"))
        if info.field_name == "max_backoff_s" and v < info.data.get("reconnect_backoff_s", 0):
            raise ValueError(f"must be >= reconnect_backoff_s ({info.data['reconnect_backoff_s']})")
        return v

    @field_validator("username", "password", "tls_ca_file", "tls_cert_file", "tls_key_file")
    @classmethod
    def _nonempty(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v:
            raise ValueError("must be a non-empty string or null")
        return v

    @model_validator(mode="after")
    def _together(self) -> "RedisStoreConfig":
        if self.mode == "cluster" and not self.nodes:
            raise ValueError("l3.redis.nodes: cluster mode needs the seed nodes ['HOST:PORT', ...]")
        if self.mode == "standalone" and self.nodes:
            raise ValueError("l3.redis.nodes: seed nodes are for mode 'cluster' (standalone uses l3.redis.url)")
        if self.tls_cert_file and not self.tls_key_file or self.tls_key_file and not self.tls_cert_file:
            raise ValueError("l3.redis.tls_cert_file and l3.redis.tls_key_file go together")
        return self

    @property
    def use_tls(self) -> bool:
        return self.tls or self.url.startswith("rediss://")


def check_options(cfg: dict) -> RedisStoreConfig:
    """Validate the ``l3.redis`` section without connecting.

    Raises:
        ConfigError: naming ``l3.redis.<key>`` and what is allowed.
    """
    try:
        return RedisStoreConfig.model_validate(cfg)
    except ValidationError as e:
        raise config_error(e, "l3.redis", RedisStoreConfig) from None


__all__ = ["RedisStoreConfig", "check_options", "parse_node", "URL_SCHEMES", "ConfigError"]
