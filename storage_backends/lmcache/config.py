"""The ``l3.lmcache`` options of the LMCache store, validated without connecting: :class:`LMCacheStoreConfig`.

Every error names ``l3.lmcache.<key>`` and what is allowed (:func:`check_options` raises ``ConfigError``).
"""
from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from tierkv.storage_backends.common import config_error

#: characters ``model_name`` may not hold
_FORBIDDEN = set("@/\\\0")


class LMCacheStoreConfig(BaseModel):
    """The ``l3.lmcache`` section (keyword arguments of :class:`LMCacheStore`)."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str = "tcp://127.0.0.1:5555"
    #: tokens per tierkv page; must equal the server's ``--chunk-size``
    page_tokens: int = Field(gt=0)
    #: label put in front of the namespace in LMCache's ``model_name``
    model_name: str = "tierkv"
    world_size: int = Field(default=1, ge=1)
    worker_id: int = Field(default=0, ge=0)
    timeout_s: float = Field(default=2.0, gt=0)
    reconnect_backoff_s: float = Field(default=0.05, ge=0)
    max_backoff_s: float = Field(default=1.0, ge=0)
    #: where the server's shared-memory segment is mapped from
    shm_dir: str = "/dev/shm"

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        if not v.startswith(("tcp://", "ipc://")):
            raise ValueError("must look like 'tcp://HOST:PORT' or 'ipc://PATH'")
        return v

    @field_validator("page_tokens")
    @classmethod
    def _page_tokens(cls, v: int) -> int:
        if v < 4:
            raise ValueError("must be >= 4 (a page named by its key alone needs four token ids)")
        return v

    @field_validator("model_name")
    @classmethod
    def _model(cls, v: str) -> str:
        if not v or len(v) > 64 or _FORBIDDEN & set(v):
            raise ValueError("must be 1-64 characters without '@', '/', '\\' or NUL")
        return v

    @field_validator("timeout_s", "reconnect_backoff_s", "max_backoff_s")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number of seconds")
        return v

    @field_validator("max_backoff_s")
    @classmethod
    def _max_backoff(cls, v: float, info: ValidationInfo) -> float:
        first = info.data.get("reconnect_backoff_s")
        if first is not None and v < first:
            raise ValueError(f"must be >= reconnect_backoff_s ({first})")
        return v

    @field_validator("worker_id")
    @classmethod
    def _worker(cls, v: int, info: ValidationInfo) -> int:
        n = info.data.get("world_size")
        if n is not None and v >= n:
            raise ValueError(f"must be < l3.lmcache.world_size ({n})")
        return v


def check_options(cfg: dict) -> LMCacheStoreConfig:
    """Validate the ``l3.lmcache`` section without connecting.

    Raises:
        ConfigError: naming ``l3.lmcache.<key>`` and what is allowed.
    """
    try:
        return LMCacheStoreConfig.model_validate(cfg)
    except ValidationError as e:
        raise config_error(e, "l3.lmcache", LMCacheStoreConfig) from None



__all__ = ["LMCacheStoreConfig", "check_options"]
