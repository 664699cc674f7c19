"""Self-describing page records of every L3 backend: ``header || payload``; the header (little-endian, 64 bytes):

| offset | size | field |
|---|---|---|
| 0 | 4 | magic ``b"TKVP"`` |
| 4 | 2 | format version (:data:`VERSION`) |
| 6 | 2 | flags (0) |
| 8 | 16 | namespace digest (:meth:`tierkv.connector.core.page_hash.ModelNamespace.digest`) |
| 24 | 16 | page key (raw 16 bytes of the hex key) |
| 40 | 8 | payload length in bytes |
| 48 | 8 | XXH3-64 of the payload (:func:`payload_checksum`; given by the caller or computed at set time) |
| 56 | 8 | XXH3-64 of bytes 0..56 (header checksum) |

A reader checks every field against what it expects (namespace, key, length) and both checksums: a truncated,
corrupted, foreign or planted record is a miss, never data. Nothing here unpickles or builds objects from stored bytes.
"""
from __future__ import annotations

import operator
import re
import struct
from typing import Any, Optional, Sequence, Union

import xxhash

MAGIC = b"TKVP"
VERSION = 1
_FMT = struct.Struct("<4sHH16s16sQQ")
_TAIL = struct.Struct("<Q")
HEADER_BYTES = _FMT.size + 8  # 64
assert HEADER_BYTES == 64
KEY_BYTES = 16
_HEX_RE = re.compile(r"^[0-9a-f]{32}$")


class PageFormatError(ValueError):
    """A stored record is not a valid page for the expected key/namespace/length (a miss, not data)."""


def check_key(key: str) -> bytes:
    """Validate a page key's text form (32 lowercase hex chars) and return its 16 raw bytes.

    Raises:
        ValueError: the key is not a str of 32 lowercase hex chars (so no key can name a path or inject text).
    """
    if not isinstance(key, str) or not _HEX_RE.match(key):
        raise ValueError(f"invalid page key {key!r}: expected {2 * KEY_BYTES} lowercase hex characters")
    return bytes.fromhex(key)


def payload_checksum(payload: Any) -> int:
    """XXH3-64 (``xxhash.xxh3_64_intdigest``) of a payload's bytes: the value at header offset 48, and what a caller
    passes in ``batch_set(..., checksums=...)`` when it has hashed the page already (e.g. when the page entered the
    L2 host pool). ``payload``: any C-contiguous buffer (bytes, bytearray, memoryview, numpy array), or a list or
    tuple of such runs whose bytes in order are the payload (hashed in one streaming pass: the same value as hashing
    their concatenation)."""
    if isinstance(payload, (list, tuple)):
        h = xxhash.xxh3_64()
        for run in payload:
            h.update(run)
        return h.intdigest()
    return xxhash.xxh3_64_intdigest(memoryview(payload).cast("B"))


_U64_MAX = (1 << 64) - 1


def check_checksums(checksums: Any, n: int) -> Optional[list[int]]:
    """Validate the optional ``checksums`` argument of ``batch_set`` for ``n`` pages: ``None`` (the store hashes
    each payload itself) or a sequence of exactly ``n`` integers in 0..2**64-1 (Python ints or numpy integers:
    the XXH3-64 of each source's payload, see :func:`payload_checksum`). Returns them as a list of Python ints
    (or None).

    Raises:
        ValueError: not a sequence, a length other than ``n``, or an element that is not an integer in range.
    """
    if checksums is None:
        return None
    if isinstance(checksums, (str, bytes, bytearray, memoryview)) or not hasattr(checksums, "__len__"):
        raise ValueError(f"checksums must be a sequence of {n} ints (XXH3-64 of each payload) or None, got "
                         f"{type(checksums).__name__}")
    if len(checksums) != n:
        raise ValueError(f"{n} pages but {len(checksums)} checksums")
    out = []
    for i, c in enumerate(checksums):
        try:
            if isinstance(c, bool):
                raise TypeError
            v = operator.index(c)
        except TypeError:
            raise ValueError(f"checksums[{i}] is not an int: {c!r:.40}") from None
        if not 0 <= v <= _U64_MAX:
            raise ValueError(f"checksums[{i}] = {v} is not a 64-bit unsigned value")
        out.append(v)
    return out


def encode_header(key: str, namespace: bytes, payload: Union[bytes, bytearray, memoryview],
                  checksum: Optional[int] = None) -> bytes:
    """Header for ``payload`` stored under ``key`` (text form) in ``namespace`` (16 bytes). ``checksum``: the
    payload's XXH3-64 if the caller has it (written as given, the payload is not hashed; a wrong value makes the
    record fail verification when read); ``None``: computed here. The caller validates a given ``checksum``
    (:func:`check_checksums`).

    Raises:
        ValueError: ``namespace`` is not 16 bytes or ``key`` is not 32 lowercase hex characters.
    """
    if len(namespace) != 16:
        raise ValueError(f"namespace digest must be 16 bytes, got {len(namespace)}")
    mv = memoryview(payload).cast("B")
    return _pack_header(namespace, check_key(key), mv.nbytes,
                        xxhash.xxh3_64_intdigest(mv) if checksum is None else checksum)


def _pack_header(namespace: bytes, key_raw: bytes, nbytes: int, payload_sum: int) -> bytes:
    head = _FMT.pack(MAGIC, VERSION, 0, namespace, key_raw, nbytes, payload_sum)
    return head + _TAIL.pack(xxhash.xxh3_64_intdigest(head))


def encode_headers(keys_raw: Sequence[bytes], namespace: bytes, payloads: Sequence[Any], page_bytes: int,
                   checksums: Optional[Sequence[int]] = None) -> list:
    """Headers of many pages at once: the same bytes as :func:`encode_header` per page, for callers that have
    already validated the keys (``keys_raw``: the 16 raw bytes :func:`check_key` returns) and the payload sizes
    (``payloads``: C-contiguous byte buffers of ``page_bytes`` bytes each, e.g. memoryviews or numpy arrays).
    Skips the per-page re-validation, which costs about as much as the XXH3 of a 256 KiB page on a busy core.
    ``checksums``: the payloads' XXH3-64 values, already validated by :func:`check_checksums` (written as given;
    no payload is hashed, only the 56 header bytes); ``None``: each payload is hashed here.

    Raises:
        ValueError: ``namespace`` is not 16 bytes, a raw key is not 16 bytes, or the list lengths differ.
    """
    if len(namespace) != 16:
        raise ValueError(f"namespace digest must be 16 bytes, got {len(namespace)}")
    if len(keys_raw) != len(payloads):
        raise ValueError(f"encode_headers: {len(keys_raw)} keys but {len(payloads)} payloads")
    if checksums is not None and len(checksums) != len(keys_raw):
        raise ValueError(f"encode_headers: {len(keys_raw)} keys but {len(checksums)} checksums")
    for k in keys_raw:
        if len(k) != KEY_BYTES:
            raise ValueError(f"raw page key must be {KEY_BYTES} bytes, got {len(k)}")
    if checksums is None:
        h64 = xxhash.xxh3_64_intdigest
        checksums = [h64(p) for p in payloads]
    return [_pack_header(namespace, k, page_bytes, c) for k, c in zip(keys_raw, checksums)]


def decode_header(header: Union[bytes, memoryview], key: str, namespace: bytes, page_bytes: int) -> int:
    """Check a header against the expected key, namespace and payload length.

    Returns the payload's expected XXH3-64 checksum. Raises :class:`PageFormatError` on any mismatch.
    """
    hb = bytes(header[:HEADER_BYTES])
    if len(hb) < HEADER_BYTES:
        raise PageFormatError("truncated header")
    head, (hsum,) = hb[: _FMT.size], struct.unpack("<Q", hb[_FMT.size :])
    if xxhash.xxh3_64_intdigest(head) != hsum:
        raise PageFormatError("header checksum mismatch")
    magic, version, _flags, ns, kraw, length, psum = _FMT.unpack(head)
    if magic != MAGIC:
        raise PageFormatError("bad magic")
    if version != VERSION:
        raise PageFormatError(f"unsupported page format version {version}")
    if ns != namespace:
        raise PageFormatError("page belongs to another namespace")
    if kraw != check_key(key):
        raise PageFormatError("page belongs to another key")
    if length != page_bytes:
        raise PageFormatError(f"payload length {length} != expected {page_bytes}")
    return psum


def verify_payload(payload: Any, checksum: int) -> None:
    """Raise :class:`PageFormatError` unless XXH3-64 of ``payload`` (a buffer, or a list or tuple of runs:
    :func:`payload_checksum`) equals ``checksum``."""
    if payload_checksum(payload) != checksum:
        raise PageFormatError("payload checksum mismatch")


def copy_into(dst: Any, src: memoryview) -> None:
    """Copy the flat byte view ``src`` into ``dst``: one flat writable byte view of the same length, or a list of
    them (a destination's runs) whose lengths add up to it, filled in order."""
    if isinstance(dst, list):
        o = 0
        for run in dst:
            n = run.nbytes
            run[:] = src[o:o + n]
            o += n
    else:
        dst[:] = src


def copy_verified(header: Union[bytes, memoryview], payload: Any, dst: Any, key: str, namespace: bytes,
                  page_bytes: int) -> int:
    """Verify, then copy: check ``header`` against ``key``, ``namespace`` and ``page_bytes``
    (:func:`decode_header`), ``payload`` (any C-contiguous buffer) for its length and its XXH3-64 against the header,
    and only then copy it into ``dst`` (a writable flat byte view of ``page_bytes``, or a list of such views of runs
    adding up to it: :func:`copy_into`). The read path of the stores whose records come from memory no other process
    writes (ZMQ frames, Mooncake staging, LMCache slots under a read lock). Returns the payload's XXH3-64 (the value
    verified). Raises :class:`PageFormatError` (``dst`` untouched)."""
    psum = decode_header(header, key, namespace, page_bytes)
    pv = memoryview(payload).cast("B")
    if pv.nbytes != page_bytes:
        raise PageFormatError(f"payload of {pv.nbytes} bytes, expected {page_bytes}")
    verify_payload(pv, psum)
    copy_into(dst, pv)
    return psum


def encode_record(key: str, namespace: bytes, payload: Union[bytes, bytearray, memoryview]) -> bytes:
    """``header || payload`` as one bytes object (convenience; backends may write the two parts separately)."""
    return encode_header(key, namespace, payload) + bytes(payload)


def decode_record(record: Union[bytes, memoryview], key: str, namespace: bytes, page_bytes: int) -> memoryview:
    """Check a whole record and return a memoryview of its payload. Raises :class:`PageFormatError`."""
    mv = memoryview(record).cast("B")
    if mv.nbytes != HEADER_BYTES + page_bytes:
        raise PageFormatError(f"record of {mv.nbytes} bytes, expected {HEADER_BYTES + page_bytes}")
    psum = decode_header(mv[:HEADER_BYTES], key, namespace, page_bytes)
    payload = mv[HEADER_BYTES:]
    verify_payload(payload, psum)
    return payload


def read_header(header: Union[bytes, memoryview]) -> dict:
    """Decode a header without expecting a key or namespace (for tools that walk a store: ``tierkv store stats``,
    ``tierkv store verify``). Returns ``{"version", "namespace" (16 bytes), "key" (hex), "length", "checksum"}``.

    Raises:
        PageFormatError: fewer than 64 bytes, header checksum mismatch or bad magic. A version other than
            :data:`VERSION` is returned, not raised: the caller decides (a newer version is not corrupt, it is a
            record this build cannot read).
    """
    hb = bytes(header[:HEADER_BYTES])
    if len(hb) < HEADER_BYTES:
        raise PageFormatError("truncated header")
    head, (hsum,) = hb[: _FMT.size], struct.unpack("<Q", hb[_FMT.size:])
    magic, version, _flags, ns, kraw, length, psum = _FMT.unpack(head)
    if magic != MAGIC:
        raise PageFormatError("bad magic")
    if xxhash.xxh3_64_intdigest(head) != hsum:
        raise PageFormatError("header checksum mismatch")
    return {"version": version, "namespace": ns, "key": kraw.hex(), "length": length, "checksum": psum}


def check_record(header: Union[bytes, memoryview], payload: Any, key: Optional[str] = None,
                 namespace: Optional[bytes] = None) -> dict:
    """Check a whole stored record (``header``, ``payload`` as separate buffers) without knowing the page size:
    :func:`read_header`, then (for a record of this :data:`VERSION`) key and namespace when given, payload length
    and payload XXH3-64. Returns the :func:`read_header` dict.

    Raises:
        PageFormatError: anything wrong; the message is a short reason (``"payload checksum mismatch"``, ...).
        NewerFormatError: the record was written by a newer page format version (not checked further).
    """
    info = read_header(header)
    if info["version"] > VERSION:
        raise NewerFormatError(f"page format version {info['version']} is newer than this build's {VERSION}")
    if info["version"] != VERSION:
        raise PageFormatError(f"unsupported page format version {info['version']}")
    if namespace is not None and info["namespace"] != namespace:
        raise PageFormatError("page belongs to another namespace")
    if key is not None and info["key"] != key:
        raise PageFormatError("page belongs to another key")
    mv = memoryview(payload).cast("B")
    if mv.nbytes != info["length"]:
        raise PageFormatError("payload length mismatch")
    verify_payload(mv, info["checksum"])
    return info


class NewerFormatError(PageFormatError):
    """A record written by a newer page format version than this build reads (not corrupt: do not delete it)."""
