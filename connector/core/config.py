"""tierkv configuration: one YAML file, validated at start-up.

Sources, later ones win:
1. the shipped ``configs/default.yaml`` (``tierkv.configs``),
2. a file named by ``config_file`` (in vLLM: ``kv_connector_extra_config["config_file"]``),
3. overrides given as a (nested) dict, e.g. the rest of ``kv_connector_extra_config``; dotted keys
   (``"host_pool.layout": "page_first"``) are accepted too.

Every key is declared below; an unknown key or a bad value raises :class:`ConfigError` naming the key
and the allowed values. Nothing here imports an engine.
"""
from __future__ import annotations

import copy
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tierkv.storage_backends.common import ConfigError, unknown_key  # noqa: F401 - re-exported: ConfigError
from tierkv.storage_backends.eviction import POLICIES as EVICTION_POLICIES
from tierkv.storage_backends.factory import L3_ADMISSIONS, L3Config, validate_l3  # noqa: F401 - re-exported
from tierkv.connector.core.page_hash import check_salt, resolve_salt
from tierkv.connector.cpu.thread_priority import WRITER_PRIORITIES

#: the names below are defined here only; the host pool, the controller and the config models use them
HOST_POOL_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
#: which forwards the L3 writer starts no backup batch during (:class:`tierkv.connector.l2.step.WorkerStep`)
BACKUP_PAUSES = ("prefill", "forward", "never")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class HostPoolConfig(_Strict):
    """L2 host pool, per worker. Give ``size_gb`` (GiB of DRAM) or ``num_pages``; neither = an automatic size
    (``auto_fraction`` of the host budget, divided among the engine's ranks on the host, at most ``auto_max_gb``
    per rank). The host budget is ``min(MemAvailable, cgroup room) - reserve_gb``, shared by every worker of every
    engine on the host; pools that do not fit stop start-up (:mod:`tierkv.connector.l2.host_budget`)."""

    size_gb: Optional[float] = Field(default=None, gt=0)
    num_pages: Optional[int] = Field(default=None, gt=0)
    layout: Literal[HOST_POOL_LAYOUTS] = "layer_first"
    pin_memory: Literal["auto", "true", "false"] = "auto"
    auto_fraction: float = Field(default=0.25, gt=0, le=0.9)
    auto_max_gb: float = Field(default=8.0, gt=0)
    reserve_gb: float = Field(default=2.0, ge=0)


class ControllerConfig(_Strict):
    """Backup (L1->L2->L3) and prefetch (L3->L2->L1) policies, after SGLang HiCache's ``--hicache-write-policy``
    and ``--hicache-storage-prefetch-policy``; used only when ``l3.backend`` is not ``none``
    (:mod:`tierkv.connector.l3.controller`): with ``none``, values other than the defaults are
    a ConfigError (:func:`check_controller_used`). Times in seconds, sizes in pages."""

    write_policy: Literal[WRITE_POLICIES] = "write_through"
    write_through_threshold: int = Field(default=2, ge=1)
    prefetch_policy: Literal[PREFETCH_POLICIES] = "best_effort"
    prefetch_timeout_base_s: float = Field(default=0.5, gt=0)
    prefetch_timeout_per_page_s: float = Field(default=0.005, ge=0)
    exists_wait_s: float = Field(default=1.0, ge=0)
    negative_ttl_s: float = Field(default=2.0, ge=0)
    room_retry_steps: int = Field(default=8, ge=0)
    room_wait_s: float = Field(default=0.5, ge=0)
    probe_interval_s: float = Field(default=5.0, gt=0)
    sync_load_max_s: float = Field(default=0.02, ge=0)
    exists_in_scheduler: bool = True
    max_index_pages: int = Field(default=1 << 22, ge=1)
    batch_pages: int = Field(default=16, ge=1, le=4096)
    read_threads: Optional[int] = Field(default=None, ge=1, le=64)
    max_backup_pages: int = Field(default=65536, ge=1)
    shutdown_drain_s: float = Field(default=10.0, ge=0)
    gil_switch_interval_s: float = Field(default=0.05, ge=0, le=1.0)
    writer_priority: Literal[WRITER_PRIORITIES] = "normal"
    #: a tier (L2 or L3) that wrote more than this and served under 1 % of it is warned about (0 = never); read by
    #: :mod:`tierkv.connector.obs.tier_bytes`, with or without an L3 store
    write_only_warn_bytes: int = Field(default=1 << 30, ge=0)
    backup_pause: Literal[BACKUP_PAUSES] = "never"

    def scheduler_kwargs(self) -> dict:
        """Keyword arguments of :class:`tierkv.connector.l3.controller.Controller`."""
        return self.model_dump(exclude={"batch_pages", "read_threads", "max_backup_pages", "gil_switch_interval_s",
                                        "writer_priority", "write_only_warn_bytes", "backup_pause"})


class TierKVConfig(_Strict):
    """Top-level tierkv configuration (see ``configs/default.yaml`` for every key with comments)."""

    page_size: Optional[int] = Field(default=None, gt=0)
    model_id: Optional[str] = None
    namespace_salt: Optional[str] = Field(default=None, repr=False)
    host_pool: HostPoolConfig = Field(default_factory=HostPoolConfig)
    eviction_policy: Literal[EVICTION_POLICIES] = "lru"
    slru_protected_fraction: float = Field(default=0.8, gt=0, lt=1)
    s3fifo_small_fraction: float = Field(default=0.1, gt=0, lt=1)
    l3: L3Config = Field(default_factory=L3Config)
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    layerwise_load: bool = False
    verify_checksums: bool = False
    stats_path: Optional[str] = None
    trace_path: Optional[str] = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("namespace_salt")
    @classmethod
    def _salt(cls, v: Any) -> Optional[str]:
        # the operator's secret that enters every page key (docs/tenants.md); never echoed in an error
        return check_salt(v)

    @field_validator("stats_path")
    @classmethod
    def _stats_file(cls, v: Optional[str]) -> Optional[str]:
        # a file name template: {role} and {pid} are the only placeholders, and the name is not a directory (each
        # process creates the file's directory itself, connector/obs/metrics.py)
        if not v:
            return v
        p = os.path.expanduser(v)
        try:
            name = p.format(role="scheduler", pid=os.getpid())
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError("must be a file path whose only placeholders are {role} and {pid} "
                             f"(got {v!r}: {type(e).__name__} {e})") from None
        if not name.strip() or name.endswith(os.sep) or os.path.isdir(name):
            raise ValueError("must name a file to write the counters to, not a directory: e.g. "
                             f"{os.path.join(v.rstrip(os.sep) or '.', 'tierkv-{role}-{pid}.json')!r}")
        return p

    @field_validator("trace_path")
    @classmethod
    def _trace_file(cls, v: Optional[str]) -> Optional[str]:
        # a file the scheduler side can create: not empty, not a directory, in a directory that exists
        if v is None:
            return v
        p = os.path.expanduser(v)
        if not p.strip() or p.endswith(os.sep) or os.path.isdir(p):
            raise ValueError("must name a file to write the lookup trace to (not a directory, not empty)")
        parent = os.path.dirname(os.path.abspath(p))
        if not os.path.isdir(parent):
            raise ValueError(f"its directory {parent!r} does not exist")
        return p

    def host_pool_bytes(self, page_bytes: int, available_bytes: Optional[int] = None) -> int:
        """Bytes of DRAM for L2 given the size of one page (all layers, bytes).

        ``num_pages`` wins over ``size_gb``; with neither, ``auto_fraction`` of ``available_bytes``
        (default: the machine's total memory, a constant, so every process computes the same size) capped at
        ``auto_max_gb`` GiB."""
        hp = self.host_pool
        if hp.num_pages is not None:
            return hp.num_pages * page_bytes
        if hp.size_gb is not None:
            return int(hp.size_gb * (1 << 30))
        if available_bytes is None:
            available_bytes = _available_memory_bytes()
        return int(min(available_bytes * hp.auto_fraction, hp.auto_max_gb * (1 << 30)))


def _available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _undot(d: dict) -> dict:
    """Expand dotted keys: {"a.b": 1} -> {"a": {"b": 1}}."""
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict):
            v = _undot(v)
        if isinstance(k, str) and "." in k:
            head, rest = k.split(".", 1)
            out = _deep_merge(out, {head: _undot({rest: v})})
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


#: problems named in one config error message at most (a file that is not a config at all must not be echoed back)
MAX_ERRORS_SHOWN = 5
_KEY_LIKE = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]{0,59}")


def _short(v: Any, n: int = 60) -> str:
    t = v if isinstance(v, str) else repr(v)
    return t if len(t) <= n else t[: n - 3] + "..."


def _format_error(err: ValidationError) -> str:
    lines = []
    listed: set = set()
    errors = err.errors()
    for e in errors[:MAX_ERRORS_SHOWN]:
        key = _short(".".join(str(p) for p in e["loc"]) or "<root>")
        if e["type"] == "extra_forbidden":
            section = tuple(e["loc"][:-1])
            allowed, first = _allowed_keys(section), section not in listed
            listed.add(section)
            if not _KEY_LIKE.fullmatch(str(e["loc"][-1])):  # not a key someone mistyped: do not echo file content
                key = ".".join(str(p) for p in section + ("<an entry that is not a key, not shown>",))
                allowed = [] if not first else allowed
            lines.append(unknown_key(key, allowed, list_allowed=first))
        elif e["type"] == "literal_error":
            allowed = e.get("ctx", {}).get("expected", "")
            lines.append(f"bad value {_short(e.get('input'))!r} for '{key}': allowed values are {allowed}")
        elif e["loc"][:1] == ("namespace_salt",):  # a secret: never echoed
            lines.append(f"bad value for '{key}': {_plain(e['msg'])}")
        else:
            lines.append(f"bad value {_short(e.get('input'))!r} for '{key}': {_plain(e['msg'])}")
    if len(errors) > MAX_ERRORS_SHOWN:
        lines.append(f"and {len(errors) - MAX_ERRORS_SHOWN} more problem(s)")
    return "invalid tierkv config: " + "; ".join(lines)


def _allowed_keys(loc: tuple) -> list:
    """The keys the section at ``loc`` (a pydantic error location, e.g. ``("controller",)``) accepts; empty when the
    section is not a model (a free-form mapping)."""
    model: Any = TierKVConfig
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
        for arg in getattr(model, "__args__", ()):  # Optional[Model]: the model
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                model = arg
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return []
    return list(model.model_fields)


def _plain(msg: str) -> str:
    """pydantic's message without its "Value error, " prefix (our validators' own words follow it)."""
    return msg.removeprefix("Value error, ")


def default_config_dict() -> dict:
    """The shipped defaults (``configs/default.yaml``) as a plain dict."""
    text = resources.files("tierkv.configs").joinpath("default.yaml").read_text()
    return yaml.safe_load(text) or {}


def shipped_config_path(name: str) -> Path:
    """Path of a shipped config file, e.g. ``shipped_config_path("default.yaml")``."""
    return Path(str(resources.files("tierkv.configs").joinpath(name)))


def load_config(config_file: Optional[str | os.PathLike] = None, overrides: Optional[dict] = None) -> TierKVConfig:
    """Build a validated :class:`TierKVConfig`.

    Args:
        config_file: a YAML file; relative paths are tried as given, then among the shipped configs.
        overrides: nested or dotted keys that override the file.
    Raises:
        ConfigError: unknown key, bad value (naming the key and the allowed values), unreadable file.
    """
    data = default_config_dict()
    if config_file:
        p = Path(config_file).expanduser()
        if not p.exists():
            shipped = shipped_config_path(str(config_file))
            if shipped.exists():
                p = shipped
            else:
                raise ConfigError(f"config_file '{config_file}' not found")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config_file '{p}' is not valid YAML: {e}") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"config_file '{p}' must hold a mapping at top level")
        data = _deep_merge(data, _undot(loaded))
    if overrides:
        data = _deep_merge(data, _undot(dict(overrides)))
    try:
        cfg = TierKVConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None
    try:  # $TIERKV_NAMESPACE_SALT (containers) fills namespace_salt; both set and different is refused
        cfg.namespace_salt = resolve_salt(cfg.namespace_salt)
    except ValueError as e:
        raise ConfigError(f"invalid tierkv config: {e}") from None
    # the backend sections of ``l3`` are plain mappings here; their keys are checked by the storage layer
    validate_l3(cfg.l3)
    check_controller_used(cfg)
    return cfg


#: ``controller`` keys read without an L3 store too (the L2 tier's write-only warning)
USED_WITHOUT_L3 = ("write_only_warn_bytes",)


def check_controller_used(cfg: TierKVConfig) -> None:
    """Refuse ``controller.*`` values other than the defaults when ``l3.backend`` is ``none``: nothing reads them
    then (the controller runs only with an L3 store), so a set value would silently do nothing.

    Raises:
        ConfigError: naming each such key, its value, and that it has no effect without an L3 store.
    """
    if cfg.l3.backend != "none":
        return
    defaults = ControllerConfig()
    unused = [k for k in ControllerConfig.model_fields if getattr(cfg.controller, k) != getattr(defaults, k)
              and k not in USED_WITHOUT_L3]
    if not unused:
        return
    lines = [f"bad value {getattr(cfg.controller, k)!r} for 'controller.{k}': the controller.* keys have no "
             f"effect without an L3 store (l3.backend is 'none'); remove the key or set l3.backend"
             for k in unused[:MAX_ERRORS_SHOWN]]
    if len(unused) > MAX_ERRORS_SHOWN:
        lines.append(f"and {len(unused) - MAX_ERRORS_SHOWN} more problem(s)")
    raise ConfigError("invalid tierkv config: " + "; ".join(lines))


def config_from_extra(extra: Optional[dict]) -> TierKVConfig:
    """Config from vLLM's ``kv_connector_extra_config``: key ``config_file`` names a YAML file, every
    other key overrides it. An empty or missing dict gives the shipped defaults."""
    extra = dict(extra or {})
    cfg_file = extra.pop("config_file", None)
    return load_config(cfg_file, extra)
