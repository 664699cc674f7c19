"""Wire format shared by the tierkv ZMQ cache server (:mod:`.server`) and its client (:mod:`.client`).

A client DEALER socket talks to the server's ROUTER socket; every request and reply is one ZMQ multipart message
``[header, payload_0, ...]`` (delivered whole or not at all) whose header is a msgpack map: ``v``, ``id``, ``op``,
``keys``, ``ns``, ``token`` and op-specific fields; a reply adds ``ok`` and, when not ok, ``err`` and ``code``.
The ops, their fields, the versions and the shared-memory data path are specified in docs/developer-guide.md,
section "storage_backends/zmq/protocol.py: wire protocol".

This module holds the protocol's constants (versions, ops, limits), :func:`pack`, :func:`unpack_header` (msgpack
under strict limits: nothing is unpickled, no extension types) and the field readers the server checks requests
with; they raise :class:`ProtocolError`, whose ``code`` goes back in the error reply. Payloads are raw bytes that
the server never interprets; the client verifies every page it reads.
"""
from __future__ import annotations

import re
from typing import Any, Optional

import msgpack

#: version of the data ops (every op except the admin ops below); what :mod:`.client` speaks.
PROTOCOL_VERSION = 1
#: version that added the admin ops ``scan`` and ``verify`` (used by ``tierkv store stats|verify``). A server
#: answers requests of every version in :data:`SUPPORTED_VERSIONS` and replies with the request's version; an admin op
#: sent as version 1 is refused (``code`` ``version``), and a version-1-only server refuses version 2 the same way, so
#: a tool never mistakes an older server for one that knows the op.
ADMIN_PROTOCOL_VERSION = 2
#: version that added the shared-memory data path (``shm_attach``/``shm_detach`` and ``get``/``set`` with ``shm``);
#: a get/set naming a segment must be sent as version 3, so an older server refuses it (``code`` ``version``)
#: instead of answering as if the field were absent, and the client falls back to payload frames.
SHM_PROTOCOL_VERSION = 3
SUPPORTED_VERSIONS = (1, 2, 3)

#: ops every server answers.
OPS = ("ping", "exists", "get", "set", "delete", "clear", "stats", "scan", "verify", "shm_attach", "shm_detach")
#: ops that need ``v`` >= :data:`ADMIN_PROTOCOL_VERSION`.
ADMIN_OPS = ("scan", "verify")
#: ops that need ``v`` >= :data:`SHM_PROTOCOL_VERSION`.
SHM_OPS = ("shm_attach", "shm_detach")
#: every client segment is named ``SHM_PREFIX`` + 16 to 64 lowercase hex digits (no path separators, nothing else
#: under /dev/shm can be named).
SHM_PREFIX = "tierkv-shm-"
SHM_NAME_RE = re.compile(r"^tierkv-shm-[0-9a-f]{16,64}$")
SHM_DIR = "/dev/shm"
#: largest segment a server maps (bytes).
MAX_SHM_BYTES = 1 << 40
#: upper bounds (seconds) of the age histogram returned by ``scan``; the last bucket is open-ended.
AGE_BUCKETS_S = (60, 600, 3600, 6 * 3600, 86400, 7 * 86400)
#: ops answered only by a server started with ``--enable-test-ops``.
TEST_OPS = ("t_corrupt",)
CORRUPT_HOWS = ("truncate", "flip", "foreign_namespace")

#: largest header frame (msgpack map) in bytes, either direction.
MAX_HEADER_BYTES = 4 << 20
#: most keys in one request (the client splits larger batches).
MAX_KEYS = 16384
#: largest page record header (bin) carried in a header (a :mod:`.page_format` header is 64 bytes).
MAX_RECORD_HEADER_BYTES = 256
#: largest string field (op, key, token, error text).
MAX_STR_BYTES = 4096
#: default bound on one whole multipart message (header + payloads), bytes; both sides refuse larger.
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
#: uint64 range of request ids.
MAX_ID = (1 << 64) - 1

NS_BYTES = 16
KEY_RE = re.compile(r"^[0-9a-f]{32}$")


class ProtocolError(ValueError):
    """A frame is malformed, oversized, of the wrong type or disagrees with the frame count.

    ``code`` is a short machine-readable reason sent back in error replies (``bad_header``, ``bad_request``,
    ``too_large``, ``auth``, ``version``, ``unknown_op``, ``shm``, ``shm_unknown``)."""

    def __init__(self, code: str, msg: str):
        super().__init__(msg)
        self.code = code


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError("bad_header", f"msgpack extension type {code} is not allowed")


def pack(obj: dict) -> bytes:
    """msgpack-encode a header map (``use_bin_type`` so bytes stay bytes)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack_header(frame: Any, *, max_map_len: int = 32, max_array_len: int = MAX_KEYS,
                  max_header_bytes: int = MAX_HEADER_BYTES) -> dict:
    """Decode one header frame (bytes-like) into a dict under strict limits.

    Raises:
        ProtocolError: frame larger than ``max_header_bytes``; not msgpack; trailing bytes; extension types;
            a bin/str/array/map over its limit; nesting deeper than the decoder's stack; top level not a map
            with str keys.
    """
    mv = memoryview(frame)
    if mv.nbytes > max_header_bytes:
        raise ProtocolError("too_large", f"header frame of {mv.nbytes} bytes > limit {max_header_bytes}")
    try:
        obj = msgpack.unpackb(
            mv,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_no_ext,
            max_ext_len=0,
            max_bin_len=MAX_RECORD_HEADER_BYTES,
            max_str_len=MAX_STR_BYTES,
            max_array_len=max_array_len,
            max_map_len=max_map_len,
        )
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises ValueError/StackError/ExtraData/FormatError/UnicodeDecodeError...
        raise ProtocolError("bad_header", f"undecodable header: {type(e).__name__}: {e}"[:300]) from None
    if not isinstance(obj, dict):
        raise ProtocolError("bad_header", f"header must be a msgpack map, got {type(obj).__name__}")
    return obj


def brief(v: Any) -> str:
    """A short, safe description of an untrusted value for error text: the repr of a scalar (cut to 60 chars),
    else only its type (a deeply nested container is never repr'd)."""
    if v is None or isinstance(v, (bool, int, float)):
        return repr(v)[:60]
    if isinstance(v, (str, bytes)):
        return repr(v[:60])
    return f"<{type(v).__name__}>"


def get_int(h: dict, name: str, lo: int = 0, hi: int = MAX_ID, default: Optional[int] = None) -> int:
    """Field ``name`` of header ``h`` as an int in [lo, hi] (bools refused). Raises :class:`ProtocolError`."""
    v = h.get(name, default)
    if type(v) is not int or not lo <= v <= hi:
        raise ProtocolError("bad_request", f"field {name!r} must be an integer in [{lo}, {hi}], got {brief(v)}")
    return v


def get_str(h: dict, name: str, default: Optional[str] = None) -> str:
    v = h.get(name, default)
    if not isinstance(v, str):
        raise ProtocolError("bad_request", f"field {name!r} must be a string, got {type(v).__name__}")
    return v


def get_bool(h: dict, name: str, default: bool = False) -> bool:
    v = h.get(name, default)
    if not isinstance(v, bool):
        raise ProtocolError("bad_request", f"field {name!r} must be a bool, got {type(v).__name__}")
    return v


def get_keys(h: dict, name: str = "keys") -> list:
    """The ``keys`` list: each a str of 32 lowercase hex characters. Raises :class:`ProtocolError`."""
    v = h.get(name, [])
    if not isinstance(v, list):
        raise ProtocolError("bad_request", f"field {name!r} must be an array of keys")
    for k in v:
        if not isinstance(k, str) or not KEY_RE.match(k):
            raise ProtocolError("bad_request", f"invalid key {brief(k)} in {name!r}: expected 32 lowercase hex chars")
    return v


def get_ns(h: dict) -> bytes:
    """The 16-byte namespace digest ``ns``. Raises :class:`ProtocolError`."""
    v = h.get("ns")
    if not isinstance(v, bytes) or len(v) != NS_BYTES:
        raise ProtocolError("bad_request", f"field 'ns' must be a bin of {NS_BYTES} bytes")
    return v


def get_bins(h: dict, name: str, count: int) -> list:
    """A list of exactly ``count`` non-empty bin fields. Raises :class:`ProtocolError`."""
    v = h.get(name)
    if not isinstance(v, list) or len(v) != count:
        raise ProtocolError("bad_request", f"field {name!r} must be an array of {count} bin values")
    for b in v:
        if not isinstance(b, bytes) or not b:
            raise ProtocolError("bad_request", f"field {name!r} must hold non-empty bin values")
    return v


def error_reply(req_id: int, op: str, code: str, msg: str, v: int = PROTOCOL_VERSION) -> bytes:
    """Encoded error reply header (``v``: the request's version when it is one the server speaks)."""
    return pack({"v": v, "id": req_id, "op": op, "ok": False, "code": code, "err": msg[:MAX_STR_BYTES]})


def get_shm_name(h: dict, name: str = "name") -> str:
    """A segment name matching :data:`SHM_NAME_RE` (our prefix, hex, no path separator).

    Raises :class:`ProtocolError`."""
    v = h.get(name)
    if not isinstance(v, str) or not SHM_NAME_RE.match(v):
        raise ProtocolError("bad_request", f"field {name!r} must be a segment name {SHM_PREFIX}<16-64 hex digits>, "
                                           f"got {brief(v)}")
    return v


def get_offsets(h: dict, count: int, length: int, size: int) -> list:
    """``offs``: exactly ``count`` ints with ``0 <= off`` and ``off + length <= size`` (bytes).

    Raises :class:`ProtocolError`."""
    v = h.get("offs")
    if not isinstance(v, list) or len(v) != count:
        raise ProtocolError("bad_request", f"field 'offs' must be an array of {count} offsets")
    hi = size - length
    for o in v:
        if type(o) is not int or not 0 <= o <= hi:
            raise ProtocolError("bad_request", f"slot offset {brief(o)} with len {length} is outside the segment of "
                                               f"{size} bytes")
    return v
