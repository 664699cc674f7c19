"""Pieces shared by the L3 backends: the configuration error type, byte-size parsing, turning pydantic errors into
messages that name ``l3.<backend>.<key>``, flat byte views of caller buffers and a rate-limited warning logger.

This module is the bottom of ``tierkv.storage_backends``: it imports nothing from tierkv, so the storage layer never
depends on the connector (``tierkv.connector.core.config`` imports :class:`ConfigError` from here and re-exports it).
"""
from __future__ import annotations

import ctypes
import difflib
import logging
import sys
import threading
import time
from typing import Any, Optional, Union

from pydantic import ValidationError

__all__ = ["ConfigError", "parse_bytes", "config_error", "unknown_key", "as_byte_view", "as_byte_runs", "RateLimitedLog",
           "Counters", "STORE_COUNTERS"]


class ConfigError(ValueError):
    """Invalid tierkv configuration. The message names the key (dotted path) and what is allowed."""


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_bytes(value: Union[int, str]) -> int:
    """``6291456``, ``"6MiB"``, ``"6 MB"``, ``"1.5GiB"`` -> bytes (int). Raises ValueError for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"not a byte size: {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        s = value.strip().lower().replace(" ", "").replace("_", "")
        num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = s[len(num):]
        if num and unit in _UNITS:
            try:
                return int(float(num) * _UNITS[unit])
            except ValueError:
                pass
    raise ValueError(f"not a byte size: {value!r} (use an int or a string like '6MiB', '10GB')")


def check_store_identity(namespace: Any, page_bytes: Any, error: type = ValueError) -> bytes:
    """The two arguments every store is built with, checked: ``namespace`` a 16-byte digest, ``page_bytes`` a
    positive int (bytes of one page payload). Returns the namespace as ``bytes``. Raises ``error`` (ValueError by
    default; the Mooncake store documents TypeError) naming the bad argument."""
    if not isinstance(namespace, (bytes, bytearray)) or len(namespace) != 16:
        raise error(f"namespace must be a 16-byte digest, got {namespace!r:.60}")
    if isinstance(page_bytes, bool) or not isinstance(page_bytes, int) or page_bytes <= 0:
        raise error(f"page_bytes must be a positive int, got {page_bytes!r}")
    return bytes(namespace)


def unknown_key(key: str, allowed, list_allowed: bool = True) -> str:
    """The one message for an unknown config key, wherever it is found: ``unknown config key 'KEY' (did you mean
    'NEAREST'?): allowed keys are 'a', 'b'``. The suggestion is the allowed key closest to the last part of ``key``
    (:func:`difflib.get_close_matches`), left out when none is close; the list is left out when ``list_allowed`` is
    false (a second unknown key of a section already listed) or nothing is allowed."""
    allowed = sorted(str(k) for k in allowed)
    section, _, leaf = key.rpartition(".")
    near = difflib.get_close_matches(leaf, allowed, n=1, cutoff=0.6)
    msg = f"unknown config key '{key}'"
    if near:
        msg += f" (did you mean '{section + '.' if section else ''}{near[0]}'?)"
    if list_allowed and allowed:
        msg += ": allowed keys are " + ", ".join(f"'{k}'" for k in allowed)
    return msg


def config_error(err: ValidationError, prefix: str, model: Optional[type] = None) -> ConfigError:
    """A :class:`ConfigError` naming each bad key as ``<prefix>.<key>`` and what is allowed (for an unknown key, the
    allowed keys when ``model``, the pydantic model that failed, is given). The value of a field declared with
    ``repr=False`` (a secret such as ``l3.zmq.token``) is shown as ``'<hidden>'``; an error of the whole section (a
    rule between its keys) does not echo the section, which may hold such a secret."""
    lines = []
    for e in err.errors():
        key = ".".join([prefix] + [str(p) for p in e["loc"]])
        field = model.model_fields.get(str(e["loc"][0])) if model is not None and e["loc"] else None
        if field is not None and not field.repr:
            e["input"] = "<hidden>"
        if not e["loc"] and e["type"] not in ("extra_forbidden", "literal_error", "missing"):
            lines.append(f"bad value for '{key}': {e['msg'].removeprefix('Value error, ')}")
        elif e["type"] == "extra_forbidden":
            lines.append(unknown_key(key, model.model_fields if model is not None else ()))
        elif e["type"] == "literal_error":
            lines.append(f"bad value {e.get('input')!r} for '{key}': allowed values are "
                         f"{e.get('ctx', {}).get('expected', '')}")
        elif e["type"] == "missing":
            lines.append(f"missing config key '{key}'")
        else:
            lines.append(f"bad value {e.get('input')!r} for '{key}': {e['msg'].removeprefix('Value error, ')}")
    return ConfigError("invalid tierkv config: " + "; ".join(lines))


_PAGE_TYPES: dict[int, type] = {}  # nbytes -> ctypes array type with room for an owner reference


def _tensor_bytes(t: Any, nbytes: int) -> memoryview:
    """A writable flat ``B`` view of a contiguous CPU tensor's ``nbytes`` bytes, built from its data pointer (cheaper
    than ``memoryview(t.reshape(-1).view(uint8).numpy())``); the view keeps ``t`` alive."""
    cls = _PAGE_TYPES.get(nbytes)
    if cls is None:
        cls = _PAGE_TYPES[nbytes] = type(f"_Page{nbytes}", (ctypes.c_ubyte * nbytes,), {})
    arr = cls.from_address(t.data_ptr())
    arr.owner = t
    return memoryview(arr).cast("B")


def as_byte_view(buf: Any, nbytes: int, writable: bool, what: str = "buffer") -> memoryview:
    """A flat ``memoryview`` (format ``B``) over ``buf`` without copying.

    Accepts a contiguous CPU ``torch.Tensor`` of any dtype (its bytes), a ``memoryview``, ``bytearray`` or (read
    only) ``bytes``. Raises ``ValueError`` if the size is not ``nbytes``, the buffer is not contiguous or not on the
    CPU, or ``writable`` is asked of a read-only buffer.
    """
    torch = sys.modules.get("torch")  # not imported here: a process without torch has no tensors to pass
    if torch is not None and isinstance(buf, torch.Tensor):
        if not buf.is_cpu:
            raise ValueError(f"{what}: tensor on {buf.device}, expected a CPU tensor")
        if buf.layout is not torch.strided or not buf.is_contiguous():
            raise ValueError(f"{what}: tensor is not contiguous")
        n = buf.nbytes
        if n != nbytes:
            raise ValueError(f"{what}: {n} bytes, expected page_bytes={nbytes}")
        return _tensor_bytes(buf, n)
    try:
        mv = memoryview(buf)
    except TypeError:
        raise ValueError(f"{what}: expected a torch.Tensor, memoryview, bytearray or bytes, "
                         f"got {type(buf).__name__}") from None
    if not mv.c_contiguous:
        raise ValueError(f"{what}: buffer is not contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if mv.nbytes != nbytes:
        raise ValueError(f"{what}: {mv.nbytes} bytes, expected page_bytes={nbytes}")
    if writable and mv.readonly:
        raise ValueError(f"{what}: destination is read-only")
    return mv


def as_byte_runs(runs: Any, nbytes: int, what: str = "buffer", writable: bool = False) -> list[memoryview]:
    """Flat ``memoryview`` (format ``B``) of each run of a page given in pieces: ``runs`` is a list or tuple of
    contiguous CPU buffers (numpy arrays, memoryviews, tensors, ``bytes``; e.g. the per-layer runs of a
    ``layer_first`` L2 slot) whose bytes, in order, are the page. No copy. Raises ``ValueError`` for an empty list,
    a run that is not a contiguous buffer, runs that do not add up to ``nbytes`` or, with ``writable`` (the runs
    are a destination), a read-only run."""
    if not runs:
        raise ValueError(f"{what}: an empty list of runs")
    torch = sys.modules.get("torch")
    out = []
    for j, r in enumerate(runs):
        if torch is not None and isinstance(r, torch.Tensor):
            out.append(as_byte_view(r, r.nbytes, writable, f"{what}[{j}]"))
            continue
        try:
            mv = memoryview(r)
        except TypeError:
            raise ValueError(f"{what}[{j}]: expected a contiguous buffer, got {type(r).__name__}") from None
        if not mv.c_contiguous:
            raise ValueError(f"{what}[{j}]: run is not contiguous")
        if writable and mv.readonly:
            raise ValueError(f"{what}[{j}]: destination run is read-only")
        out.append(mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B"))
    total = sum(m.nbytes for m in out)
    if total != nbytes:
        raise ValueError(f"{what}: runs of {total} bytes in all, expected page_bytes={nbytes}")
    return out


class RateLimitedLog:
    """Warnings to ``logger`` at most once per ``every_s`` seconds per kind, each with the number of similar ones
    suppressed since the last one. Thread-safe."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0):
        self._log, self._every = logger, every_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._every:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            self._last[kind] = now
            n = self._suppressed.pop(kind, 0)
        self._log.warning(msg + (f" (+{n} similar suppressed)" if n else ""), *args)


#: the counters every store reports in ``stats()`` under these names and with this meaning: pages a get found and
#: did not find, pages a set stored and failed to store, records that failed verification, failed operations, pages
#: evicted, payload bytes read (gets) and written (sets)
STORE_COUNTERS = ("hits", "misses", "sets", "set_failures", "corrupt", "errors", "evictions", "bytes_read",
                  "bytes_written")


class Counters(dict):
    """A store's counters: :data:`STORE_COUNTERS` and the store's own ``names``, all 0. ``add(name=n, ...)`` adds to
    several; the store provides the locking its calls need."""

    def __init__(self, *names: str):
        super().__init__(dict.fromkeys((*STORE_COUNTERS, *names), 0))

    def add(self, **deltas: float) -> None:
        for k, v in deltas.items():
            self[k] += v
